"""xFuser integration: ``--sp-strategy`` in xFuser's own CLI, USP routing, Flux fixes.

References are independent of the code under test: the single-process diffusers forward
(``FluxTransformer2DModel`` / ``CogVideoXTransformer3DModel`` / ``FluxPipeline``) with the
same weights and inputs, and the fp64 softmax attention of ``support.reference``.
"""
from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

import xfuser_swiftfusion  # noqa: F401  (CPU compatibility layer)
from xfuser_swiftfusion.integrations import xfuser as xp

xp.install()
# Import xFuser's pieces in the parent once: forked ranks inherit them.
import xfuser  # noqa: E402,F401
from xfuser.config import FlexibleArgumentParser, xFuserArgs  # noqa: E402
from xfuser.model_executor.layers import attention_processor as xf_ap  # noqa: E402
from xfuser.model_executor.layers import usp as xf_usp  # noqa: E402
from xfuser.model_executor.models.transformers import transformer_flux as xf_flux  # noqa: E402
from diffusers import CogVideoXTransformer3DModel, FluxTransformer2DModel  # noqa: E402

from xfuser_swiftfusion.emulation.launcher import run_emulated  # noqa: E402
from xfuser_swiftfusion.tools.models.tiny import tiny_checkpoint  # noqa: E402
from xfuser_swiftfusion.integrations.xfuser import state as xs  # noqa: E402
from support.reference import max_abs_err, rank_rows  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
BIN = Path(PY).parent
HEADS = 24
FLUX_CFG = dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                attention_head_dim=8, num_attention_heads=HEADS, joint_attention_dim=32,
                pooled_projection_dim=16, guidance_embeds=False, axes_dims_rope=(2, 2, 4))
COG_CFG = dict(num_attention_heads=HEADS, attention_head_dim=8, in_channels=4, out_channels=4,
               time_embed_dim=16, text_embed_dim=32, num_layers=2, sample_width=8,
               sample_height=8, sample_frames=5, patch_size=2, temporal_compression_ratio=4,
               use_rotary_positional_embeddings=False)


# ---------------------------------------------------------------------------------------------
# autoload (.pth), CLI flags, xdit process count
# ---------------------------------------------------------------------------------------------

def test_pth_autoload_installed_and_lazy():
    pth = Path(sysconfig.get_paths()["purelib"]) / "xfuser_swiftfusion_autoload.pth"
    assert pth.is_file(), f"{pth} missing: reinstall with pip install -e ."
    code = ("import sys, wrapt.importer as w; print('xfuser_swiftfusion' in sys.modules, "
            "'torch' in sys.modules, 'xfuser.envs' in w._post_import_hooks)")
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["False", "False", "True"], out


def test_autoload_never_breaks_the_interpreter(tmp_path):
    """A broken plugin package: `import xfuser` still works, one line on stderr says why."""
    (tmp_path / "xfuser_swiftfusion").mkdir()
    (tmp_path / "xfuser_swiftfusion" / "__init__.py").write_text("raise RuntimeError('half')\n")
    (tmp_path / "xfuser").mkdir()  # like xFuser: its package imports xfuser.envs first
    (tmp_path / "xfuser" / "__init__.py").write_text("from . import envs\nOK = 1\n")
    (tmp_path / "xfuser" / "envs.py").write_text("")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    out = subprocess.run([PY, "-c", "import xfuser; print('imported', xfuser.OK)"],
                         capture_output=True, text=True, env=env, timeout=60, cwd=tmp_path)
    assert out.returncode == 0 and "imported 1" in out.stdout, out
    assert "plugin not loaded (RuntimeError: half)" in out.stderr, out.stderr


def _parse(argv, world="4"):
    os.environ["WORLD_SIZE"] = world
    try:
        parser = xFuserArgs.add_runner_args(FlexibleArgumentParser())
        return parser.parse_args(argv)
    finally:
        del os.environ["WORLD_SIZE"]


def test_flag_registered_in_xfuser_args(capsys):
    ckpt = tiny_checkpoint("flux")
    assert getattr(xfuser.xFuserArgs, "__swiftfusion__", False)
    assert xfuser.config.xFuserArgs is xfuser.xFuserArgs is xFuserArgs
    ns = _parse(["--model", ckpt, "--sp-strategy", "swiftfusion", "--topology", "2x2"])
    assert (ns.sp_strategy, ns.topology) == ("swiftfusion", "2x2")
    args = xFuserArgs.from_runner_args(vars(ns))
    assert args.sp_strategy == "swiftfusion"
    assert _parse(["--model", ckpt, "--sp_strategy", "usp"]).sp_strategy == "usp"
    assert _parse(["--model", ckpt]).sp_strategy is None


def test_cuda_graph_and_launch_flags_become_strategy_options():
    from xfuser_swiftfusion.integrations.xfuser.args import strategy_options
    ckpt = tiny_checkpoint("flux")
    ns = _parse(["--model", ckpt, "--sp-strategy", "swiftfusion", "--topology", "2x2",
                 "--sf-cuda-graphs", "off", "--sf-launches", "ring"])
    args = xFuserArgs.from_runner_args(vars(ns))
    assert strategy_options(args) == {"cuda_graphs": False, "launches": "ring"}
    ns = _parse(["--model", ckpt, "--sp-strategy", "torus", "--topology", "2x2", "--sf_cuda_graphs", "on"])
    assert strategy_options(ns) == {"cuda_graphs": True}
    assert strategy_options(_parse(["--model", ckpt, "--sp-strategy", "tas", "--topology", "2x2"])) == {}


@pytest.mark.parametrize("argv, world, message", [
    (["--sp-strategy", "bogus"], "4", "invalid choice: 'bogus'"),
    (["--sp-strategy", "tas", "--topology", "2x2", "--ulysses_degree", "3"], "4",
     "must equal the 4 ranks of topology 2x2"),
    (["--sp-strategy", "tas", "--topology", "2x8", "--ulysses_degree", "16"], "16",
     "24 heads are not divisible by ulysses degree 16"),
    (["--sp-strategy", "swiftfusion", "--topology", "2x2"], "8", "topology"),
    (["--sp-strategy", "torus", "--pipefusion_parallel_degree", "2"], "4",
     "with --pipefusion_parallel_degree 2 (PipeFusion) is not supported"),
    (["--sp-strategy", "tas", "--tensor_parallel_degree", "2"], "4",
     "with --tensor_parallel_degree 2 (tensor parallelism) is not supported"),
    (["--sp-strategy", "tas", "--use_cfg_parallel", "--topology", "3x4"], "12",
     "each CFG half is one SP group of 6 ranks"),
    (["--sp-strategy", "tas", "--use_cfg_parallel", "--topology", "2x4", "--ulysses_degree", "8"],
     "8", "must equal the 4 ranks of each SP group"),
])
def test_argument_errors_are_messages(argv, world, message, capsys):
    with pytest.raises(SystemExit) as exc:
        _parse(["--model", tiny_checkpoint("flux"), *argv], world)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


@pytest.mark.parametrize("strategy", ["tas", "torus", "swiftfusion", "auto", "usp"])
def test_cfg_parallel_accepted_with_every_strategy(strategy):
    ns = _parse(["--model", tiny_checkpoint("flux"), "--sp-strategy", strategy,
                 "--use_cfg_parallel", "--topology", "4x2"], "8")
    assert (ns.sp_strategy, ns.use_cfg_parallel) == (strategy, True)


@pytest.mark.parametrize("flag", ["--pipefusion_parallel_degree", "--tensor_parallel_degree"])
def test_pipefusion_and_tensor_parallel_refusals_name_the_fix(flag, capsys):
    with pytest.raises(SystemExit):
        _parse(["--model", tiny_checkpoint("flux"), "--sp-strategy", "swiftfusion", flag, "2",
                "--use_cfg_parallel"], "8")
    err = capsys.readouterr().err
    assert f"--sp-strategy swiftfusion with {flag} 2" in err, err
    assert f"Use {flag} 1 with --sp-strategy" in err and "drop --sp-strategy" in err, err


def test_xdit_process_count():
    n = xp.xdit_nproc
    assert n(["--model", "m", "--sp-strategy", "swiftfusion", "--topology", "2x2"], 1) == 4
    assert n(["--sp-strategy", "tas", "--topology", "2x4", "--nnodes", "2"], 1) == 4
    assert n(["--sp-strategy", "usp", "--ulysses_degree", "2", "--ring_degree", "2"], 4) == 4
    assert n(["--ulysses_degree", "2"], 2) == 2                     # no flag: xFuser's rule
    # --use_cfg_parallel: --topology is the world; the degrees are each CFG half's
    assert n(["--sp-strategy", "tas", "--topology", "4x2", "--use_cfg_parallel"], 1) == 8
    assert n(["--sp-strategy", "tas", "--topology", "4x2", "--use_cfg_parallel",
              "--ulysses_degree", "2", "--ring_degree", "2"], 8) == 8
    with pytest.raises(xp.PluginError, match="must equal the 4 ranks of each SP group"):
        n(["--sp-strategy", "tas", "--topology", "4x2", "--use_cfg_parallel",
           "--ulysses_degree", "8"], 16)
    with pytest.raises(xp.PluginError, match="needs the world size"):
        n(["--sp-strategy", "swiftfusion"], 1)
    with pytest.raises(xp.PluginError, match="must equal the 4 ranks"):
        n(["--sp-strategy", "tas", "--topology", "2x2", "--ulysses_degree", "3"], 3)


# ---------------------------------------------------------------------------------------------
# use_strategy / restore_usp on 4 emulated ranks: every model on the strategy, Flux fixed
# ---------------------------------------------------------------------------------------------

def _flux_models(seed=0):
    torch.manual_seed(seed)
    ref = FluxTransformer2DModel(**FLUX_CFG).eval()
    par = xf_flux.xFuserFlux1Transformer2DWrapper(**FLUX_CFG).eval()
    par.load_state_dict(ref.state_dict())
    return ref, par


def _flux_inputs(img_tokens, text_tokens, seed=1):
    g = torch.Generator().manual_seed(seed)
    i = torch.arange(img_tokens, dtype=torch.float32)
    img_ids = torch.stack([torch.zeros_like(i), i // 4, i % 4], -1)   # [L_img, 3] (t, y, x)
    return dict(hidden_states=torch.randn(1, img_tokens, 16, generator=g),
                encoder_hidden_states=torch.randn(1, text_tokens, 32, generator=g),
                pooled_projections=torch.randn(1, 16, generator=g),
                timestep=torch.tensor([0.5]), img_ids=img_ids,
                txt_ids=torch.zeros(text_tokens, 3))


def _flux_error(ref, par, inputs) -> float:
    from xfuser.core.distributed import get_runtime_state
    get_runtime_state().max_condition_sequence_length = inputs["encoder_hidden_states"].shape[1]
    with torch.no_grad():
        want = ref(**inputs).sample.double()
        got = par(**inputs).sample.double()
    return (got - want).abs().max().item() / want.abs().max().item()


def _cog_error(ref, inputs) -> tuple[float, object]:
    """CogVideoX under xFuser's USP example wrapper (processor xFuserCogVideoXAttnProcessor2_0)."""
    import copy
    from examples.cogvideox_usp_example import parallelize_transformer
    par = copy.deepcopy(ref)

    class Pipe:
        transformer = par

    parallelize_transformer(Pipe)
    with torch.no_grad():
        want = ref(**inputs).sample.double()
        got = par(**inputs).sample.double()
    return (got - want).abs().max().item() / want.abs().max().item()


def _cog_inputs(text_tokens, seed=2):
    g = torch.Generator().manual_seed(seed)
    return dict(hidden_states=torch.randn(1, 2, 4, 8, 8, generator=g),
                encoder_hidden_states=torch.randn(1, text_tokens, 32, generator=g),
                timestep=torch.tensor([500]))


def _rank_routes_every_model():
    import torch.distributed as dist
    torch.set_num_threads(1)
    res = {}
    ctx = xp.use_strategy("swiftfusion", HEADS, "2x2")
    try:
        res["mesh"] = ctx.mesh.describe()
        res["bound"] = all(m.USP is xp.routed_usp for m in (xf_usp, xf_ap, xf_flux))
        from xfuser.model_executor.models.transformers import transformer_qwen  # loaded later
        res["bound_later"] = transformer_qwen.USP is xp.routed_usp
        ref, par = _flux_models()
        layers = FLUX_CFG["num_layers"] + FLUX_CFG["num_single_layers"]
        for text in (8, 7):                       # divisible by 4 / not (bug 2)
            ctx.reset_stats()
            res[f"flux_err_text{text}"] = _flux_error(ref, par, _flux_inputs(16, text))
            res[f"flux_calls_text{text}"] = (ctx.stats()["calls"], layers,
                                             ctx.stats()["fallbacks"])
        try:
            _flux_error(ref, par, _flux_inputs(15, 8))  # bug 1: 15 image tokens on 4 ranks
            res["bug1_routed"] = "no error"
        except xp.PluginError as exc:
            res["bug1_routed"] = str(exc)
        # The example's patch_embed all-gathers text even when it is replicated, so it needs
        # a text length divisible by the SP degree (xFuser 0.7.0 example limitation).
        for text in (8, 12):
            torch.manual_seed(0)       # learned positions cover exactly max_text_seq_length
            cog = CogVideoXTransformer3DModel(**COG_CFG, max_text_seq_length=text).eval()
            ctx.reset_stats()
            res[f"cog_err_text{text}"] = _cog_error(cog, _cog_inputs(text))
            res[f"cog_calls_text{text}"] = (ctx.stats()["calls"], COG_CFG["num_layers"])
        # fallback: a backend other than the runtime's runs xFuser's USP (TAS groups), counted once
        g = torch.Generator().manual_seed(5)
        q, k, v = (torch.randn(1, HEADS, 4 * 6, 8, generator=g) for _ in range(3))
        r = dist.get_rank()
        local = [t[:, :, r * 6:(r + 1) * 6].contiguous() for t in (q, k, v)]
        from xfuser.core.distributed.attention_backend import AttentionBackendType as T
        ctx.reset_stats()
        out = xf_ap.USP(*local, backend=T.SDPA_MATH)
        res["fallback_err"] = max_abs_err(out, rank_rows(q, k, v, r, 4))
        res["fallbacks"] = ctx.stats()["fallbacks"]
        res["calls_after_fallback"] = ctx.stats()["calls"]
    finally:
        xp.restore_usp()
    res["restored"] = all(m.USP is not xp.routed_usp for m in (xf_usp, xf_ap, xf_flux))
    res["state_torn_down"] = not xs.xfuser_parallel_initialized()
    return res


def test_use_strategy_routes_flux_and_cogvideox():
    results = run_emulated(_rank_routes_every_model, "2x2", timeout_s=240)
    for rank, res in enumerate(results):
        assert res["mesh"].startswith("U4"), res["mesh"]
        assert res["bound"] and res["bound_later"] and res["restored"], res
        assert res["state_torn_down"], res
        for text in (8, 7):
            assert res[f"flux_err_text{text}"] < 1e-4, (rank, text, res)
            calls, layers, fallbacks = res[f"flux_calls_text{text}"]
            assert calls == layers and fallbacks == {}, (rank, res)
        assert "not divisible by the SP degree 4" in res["bug1_routed"], res["bug1_routed"]
        for text in (8, 12):
            assert res[f"cog_err_text{text}"] < 1e-4, (rank, text, res)
            calls, layers = res[f"cog_calls_text{text}"]
            assert calls == layers, (rank, res)
        assert res["fallback_err"] < 1e-5, res
        assert res["fallbacks"] == {"explicit attention backend SDPA_MATH": 1}, res
        assert res["calls_after_fallback"] == 0, res


def _rank_flux_bugs():
    """xFuser 0.7.0's own path (no routing) vs the same wrapper under use_strategy('usp')."""
    torch.set_num_threads(1)
    ref, par = _flux_models()
    res = {}
    xs.init_xfuser_parallel(4, 1, "usp")
    try:
        res["bug2_pristine"] = _flux_error(ref, par, _flux_inputs(16, 7))
        try:
            _flux_error(ref, par, _flux_inputs(15, 8))
            res["bug1_pristine"] = "no error"
        except AttributeError as exc:
            res["bug1_pristine"] = str(exc)
        ctx = xp.use_strategy("usp", HEADS, "2x2")     # verifies the existing state agrees
        try:
            res["owns"] = ctx._impl.owns_state
            res["bug2_fixed_usp"] = _flux_error(ref, par, _flux_inputs(16, 7))
            res["usp_calls"] = ctx.stats()["calls"]
        finally:
            xp.restore_usp()
        res["state_kept"] = xs.xfuser_parallel_initialized()
    finally:
        xs.destroy_xfuser_parallel()
    return res


def test_flux_runner_wrapper_bugs_and_fixes():
    results = run_emulated(_rank_flux_bugs, "2x2", timeout_s=240)
    for res in results:
        assert res["bug2_pristine"] > 1e-2, res          # the bug: text K/V counted 4 times
        assert "_pad_to_sp_divisible" in res["bug1_pristine"], res
        assert res["bug2_fixed_usp"] < 1e-4, res
        assert res["usp_calls"] == 2 and res["owns"] is False and res["state_kept"], res


# ---------------------------------------------------------------------------------------------
# xFuser's runner on 4 CPU ranks: torchrun -m xfuser.runner and xdit, vs single-process diffusers
# ---------------------------------------------------------------------------------------------

RUN = ["--model", "FLUX.1-dev", "--prompt", "a cat", "--height", "64", "--width", "64",
       "--num_inference_steps", "1", "--max_sequence_length", "30", "--seed", "0"]


@pytest.fixture(scope="module")
def hf_cache(tmp_path_factory):
    """The tiny Flux checkpoint as black-forest-labs/FLUX.1-dev in a private HF hub cache."""
    root = tmp_path_factory.mktemp("hf")
    repo = root / "hub" / "models--black-forest-labs--FLUX.1-dev"
    (repo / "refs").mkdir(parents=True)
    (repo / "snapshots").mkdir()
    (repo / "snapshots" / ("0" * 40)).symlink_to(tiny_checkpoint("flux"))
    (repo / "refs" / "main").write_text("0" * 40)
    return root / "hub"


@pytest.fixture(scope="module")
def reference_image():
    """Single-process diffusers FluxPipeline, the runner's defaults (bf16, guidance 3.5)."""
    from diffusers import FluxPipeline
    pipe = FluxPipeline.from_pretrained(tiny_checkpoint("flux"), torch_dtype=torch.bfloat16)

    def image(seed):
        return np.asarray(pipe(prompt="a cat", height=64, width=64, num_inference_steps=1,
                               guidance_scale=3.5, max_sequence_length=30,
                               generator=torch.Generator("cpu").manual_seed(seed)).images[0],
                          dtype=np.int16)
    return image(0), image(1)


def _run_runner(cmd, hf_cache, out: Path) -> np.ndarray:
    from PIL import Image
    out.mkdir()
    # LOG_LEVEL=info: the strategy's stats line checked below is logged at INFO
    env = dict(os.environ, HF_HUB_CACHE=str(hf_cache), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
               SWIFTFUSION_TIMEOUT_S="120", LOG_LEVEL="info")
    res = subprocess.run(cmd + ["--output_directory", str(out)], capture_output=True, text=True,
                         env=env, timeout=400)
    log = res.stdout + res.stderr
    assert res.returncode == 0, log[-6000:]
    assert "swiftfusion (U4xR1" in log and "fallbacks {}" in log, log[-3000:]
    pngs = sorted(out.glob("*.png"))
    assert len(pngs) == 1 and (out / "timings.json").is_file(), list(out.iterdir())
    return np.asarray(Image.open(pngs[0]), dtype=np.int16)


def _assert_same_image(got, reference_image):
    want, other_seed = reference_image
    diff = np.abs(got - want)
    # bf16 (the runner's dtype) rounding: a few of 255 levels; another seed differs by far more
    assert diff.max() <= 8 and diff.mean() < 1.0, (diff.max(), diff.mean())
    assert np.abs(got - other_seed).mean() > 10 * max(diff.mean(), 0.5)


def test_torchrun_xfuser_runner_sp_strategy(hf_cache, reference_image, tmp_path):
    cmd = [str(BIN / "torchrun"), "--nproc_per_node", "4", "--master_port", "29631",
           "-m", "xfuser.runner", *RUN, "--sp-strategy", "swiftfusion", "--topology", "2x2"]
    _assert_same_image(_run_runner(cmd, hf_cache, tmp_path / "out"), reference_image)


def test_xdit_sp_strategy(hf_cache, reference_image, tmp_path):
    cmd = [str(BIN / "xdit"), "--master_port", "29641", *RUN, "--sp-strategy", "swiftfusion",
           "--topology", "2x2"]                     # xdit infers 4 processes from --topology
    _assert_same_image(_run_runner(cmd, hf_cache, tmp_path / "out"), reference_image)
