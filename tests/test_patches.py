"""The upstream-ready diffs under patches/ apply to pristine xfuser 0.7.0 and do what apply() does.

Pristine sources come from the installed wheel (no network): every file a patch touches is
checked against the wheel's RECORD hash first, then copied into a temporary tree where the
patch is dry-run (``patch -p1 --dry-run``, or ``git apply --check`` without ``patch``).
"""
from __future__ import annotations

import base64
import hashlib
import importlib.metadata as md
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PATCH_DIR = REPO / "patches"
PATCHES = sorted(PATCH_DIR.glob("*.patch"))


def _dist():
    return md.distribution("xfuser")


def _site_root() -> Path:
    return Path(_dist().locate_file(""))


def _record_hashes() -> dict[str, str]:
    hashes = {}
    for f in _dist().files or ():
        if f.hash is not None:
            hashes[str(f).replace(os.sep, "/")] = f.hash.value
    return hashes


def _patched_files(patch: Path) -> list[str]:
    files = []
    for line in patch.read_text().splitlines():
        m = re.match(r"^\+\+\+ b/(\S+)", line)
        if m:
            files.append(m.group(1))
    return files


def _sha256_b64(path: Path) -> str:
    digest = hashlib.sha256(path.read_bytes()).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def test_patch_dir_has_patches_and_readme():
    assert PATCHES, "no *.patch files under patches/"
    readme = (PATCH_DIR / "README.md").read_text()
    for p in PATCHES:
        assert p.name in readme, f"{p.name} is not described in patches/README.md"
        for f in _patched_files(p):
            assert f in readme, f"{f} (patched by {p.name}) is not listed in patches/README.md"


def test_installed_xfuser_is_0_7_0():
    assert _dist().version == "0.7.0"


def _pristine_copy(patch: Path, dest: Path) -> None:
    root = _site_root()
    record = _record_hashes()
    for rel in _patched_files(patch):
        assert rel in record, f"{rel} is not in xfuser's RECORD"
        src = root / rel
        assert _sha256_b64(src) == record[rel], (
            f"installed {rel} differs from the xfuser 0.7.0 wheel (RECORD hash mismatch): "
            "site-packages was edited; reinstall xfuser==0.7.0")
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / rel)


def _patched_copy(dest: Path) -> None:
    """A copy of the installed xfuser with every patch applied (each touched file checked
    pristine first: two patches touch usp.py, so no file is copied after a patch ran)."""
    shutil.copytree(_site_root() / "xfuser", dest / "xfuser",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for patch in PATCHES:
        _pristine_copy(patch, dest)   # the files it touches, RECORD-verified
    for patch in PATCHES:
        cmd = (["patch", "-p1", "--force", "-i", str(patch)] if shutil.which("patch")
               else ["git", "apply", "-p1", str(patch)])
        res = subprocess.run(cmd, cwd=dest, capture_output=True, text=True)
        assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.parametrize("patch", PATCHES, ids=[p.name for p in PATCHES])
def test_patch_applies_to_pristine_sources(patch: Path, tmp_path: Path):
    _pristine_copy(patch, tmp_path)
    if shutil.which("patch"):
        cmd = ["patch", "-p1", "--dry-run", "--force", "-i", str(patch)]
    else:
        cmd = ["git", "apply", "--check", "-p1", str(patch)]
    res = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True)
    assert res.returncode == 0, f"{' '.join(cmd)} failed:\n{res.stdout}\n{res.stderr}"
    assert "FAILED" not in res.stdout and "fuzz" not in res.stdout.lower(), res.stdout


_EQUIVALENCE_SCRIPT = textwrap.dedent("""
    import sys, torch
    from support.reference import attention_lse, max_abs_err, rank_rows
    from xfuser_swiftfusion.integrations.xfuser import compat as xfuser_compat
    xfuser_compat.apply = lambda: None          # the source patch alone must suffice
    import xfuser, xfuser.envs as envs
    assert xfuser.__file__.startswith(sys.argv[1]), xfuser.__file__
    assert envs.get_torch_distributed_backend() == "gloo"
    assert envs.get_device_version() is None
    assert not envs.PACKAGES_CHECKER._on_rdna4() and not envs.PACKAGES_CHECKER._on_mi3xx()
    from xfuser.core.distributed import parallel_state
    assert parallel_state.HAS_LONG_CTX_ATTN
    from xfuser.model_executor.layers import usp
    assert usp.PROCESS_GROUP is not None
    from xfuser.core.distributed.attention_backend import (
        ATTENTION_FUNCTION_REGISTRY as REG, AttentionBackendType as T)
    q, k, v = (torch.randn(1, 2, 5, 8, dtype=torch.float64) for _ in range(3))
    out, lse = REG[T.SDPA_FLASH](q, k, v, dropout_p=0.0, is_causal=False)
    ref = attention_lse(q, k, v)[1]
    assert torch.allclose(lse.double(), ref, atol=1e-6), (lse, ref)
    from xfuser.core.distributed.runtime_state import RuntimeState
    assert RuntimeState._select_attention_backend(None, None) == T.SDPA_FLASH

    from xfuser_swiftfusion.emulation.launcher import run_emulated
    from xfuser_swiftfusion.integrations.xfuser import state as xs

    def ring_only():
        import torch.distributed as dist
        xs.init_xfuser_parallel(1, 2, "usp")
        try:
            torch.manual_seed(1)
            q, k, v = (torch.randn(1, 2, 12, 8) for _ in range(3))
            r = dist.get_rank()
            o = xs.xfuser_usp(*(t[:, :, r * 6:(r + 1) * 6].contiguous() for t in (q, k, v)))
            return max_abs_err(o, rank_rows(q, k, v, r, 2))
        finally:
            xs.destroy_xfuser_parallel()

    errs = run_emulated(ring_only, "1x2", timeout_s=120)
    assert max(errs) < 1e-5, errs
    print("EQUIVALENT", errs)
""")


def test_patched_sources_work_on_cpu_without_runtime_patches(tmp_path: Path):
    """Apply every patch to a copy of the installed xfuser and run USP's ring on CPU with it."""
    _patched_copy(tmp_path)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO), str(REPO / "tests")]),
               PYTHONDONTWRITEBYTECODE="1")
    res = subprocess.run([sys.executable, "-c", _EQUIVALENCE_SCRIPT, str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=240)
    assert res.returncode == 0 and "EQUIVALENT" in res.stdout, res.stdout[-3000:] + res.stderr[-6000:]


_PLUGIN_SCRIPT = textwrap.dedent("""
    import dataclasses, sys, torch
    import xfuser                                  # the patched copy; autoload disabled
    assert xfuser.__file__.startswith(sys.argv[1]), xfuser.__file__
    from xfuser.config import FlexibleArgumentParser, xFuserArgs
    assert not getattr(xFuserArgs, "__swiftfusion__", False)   # no run-time plugin
    ns = xFuserArgs.add_runner_args(FlexibleArgumentParser()).parse_args(
        ["--model", "m", "--sp-strategy", "tas", "--topology", "2x2"])
    assert (ns.sp_strategy, ns.topology) == ("tas", "2x2")
    assert {"sp_strategy", "topology"} <= {f.name for f in dataclasses.fields(xFuserArgs)}
    from xfuser.model_executor.models.runner_models import base_model
    ev = base_model._timing_event(); ev.record(); end = base_model._timing_event(); end.record()
    assert ev.elapsed_time(end) >= 0.0
    from xfuser.model_executor.models.transformers import transformer_flux as tf
    from diffusers import FluxTransformer2DModel
    from xfuser_swiftfusion.emulation.launcher import run_emulated
    from xfuser_swiftfusion.integrations.xfuser import state as xs

    CFG = dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
               attention_head_dim=8, num_attention_heads=8, joint_attention_dim=32,
               pooled_projection_dim=16, guidance_embeds=False, axes_dims_rope=(2, 2, 4))

    def flux(img, text):
        torch.manual_seed(0)
        ref = FluxTransformer2DModel(**CFG).eval()
        par = tf.xFuserFlux1Transformer2DWrapper(**CFG).eval()
        par.load_state_dict(ref.state_dict())
        g = torch.Generator().manual_seed(1)
        i = torch.arange(img, dtype=torch.float32)
        x = dict(hidden_states=torch.randn(1, img, 16, generator=g),
                 encoder_hidden_states=torch.randn(1, text, 32, generator=g),
                 pooled_projections=torch.randn(1, 16, generator=g), timestep=torch.tensor([0.5]),
                 img_ids=torch.stack([torch.zeros_like(i), i // 4, i % 4], -1),
                 txt_ids=torch.zeros(text, 3))
        with torch.no_grad():
            want = ref(**x).sample.double()
            got = par(**x).sample.double()
        return (got - want).abs().max().item() / want.abs().max().item()

    from xfuser.model_executor.models.transformers import transformer_flux2 as tf2
    from xfuser.model_executor.models.transformers import transformer_qwen as tq
    from diffusers import Flux2Transformer2DModel, QwenImageTransformer2DModel
    F2 = dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
              attention_head_dim=8, num_attention_heads=8, joint_attention_dim=32,
              timestep_guidance_channels=16, axes_dims_rope=(2, 2, 2, 2), guidance_embeds=False)
    QW = dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=8,
              num_attention_heads=8, joint_attention_dim=32, axes_dims_rope=(2, 2, 4))

    def flux2_or_qwen(kind, img, text):
        torch.manual_seed(0)
        if kind == "flux2":
            ref = Flux2Transformer2DModel(**F2).eval()
            par = tf2.xFuserFlux2Transformer2DWrapper(**F2).eval()
        else:
            ref = QwenImageTransformer2DModel(**QW).eval()
            par = tq.xFuserQwenImageTransformerWrapper(**QW).eval()
        par.load_state_dict(ref.state_dict())
        g = torch.Generator().manual_seed(1)
        x = dict(hidden_states=torch.randn(1, img, 16, generator=g),
                 encoder_hidden_states=torch.randn(1, text, 32, generator=g),
                 timestep=torch.tensor([0.5]))
        if kind == "flux2":
            i, t = torch.arange(img, dtype=torch.float32), torch.arange(text, dtype=torch.float32)
            x["img_ids"] = torch.stack([0 * i, i // 4, i % 4, 0 * i], -1)[None]
            x["txt_ids"] = torch.stack([0 * t, 0 * t, 0 * t, t], -1)[None]
        else:
            rows = 4 if img % 4 == 0 else 3
            x["img_shapes"] = [(1, rows, img // rows)]
        with torch.no_grad():
            want = ref(**x).sample.double()
            got = par(**x).sample.double()
        return (got - want).abs().max().item() / want.abs().max().item()

    def error_of(fn, *args):
        try:
            fn(*args)
        except ValueError as exc:                  # a clear error, not padding or a crash
            return str(exc)
        return "no error"

    def rank():
        xs.init_xfuser_parallel(4, 1, "usp")
        try:
            errs = [flux(16, 7)]                   # bug 2 fixed by the source patch
            bugs = [error_of(flux, 15, 8)]         # bug 1: a clear error, not AttributeError
            for kind in ("flux2", "qwen"):         # text replicated, passed as joint tokens
                errs += [flux2_or_qwen(kind, 16, text) for text in (8, 7)]
                bugs.append(error_of(flux2_or_qwen, kind, 15, 8))
            return errs, bugs
        finally:
            xs.destroy_xfuser_parallel()

    for errs, bugs in run_emulated(rank, "2x2", timeout_s=300):
        assert max(errs) < 1e-5, errs
        for bug in bugs:
            assert "not divisible by the sequence parallel degree 4" in bug, bugs
    print("PLUGIN PATCH OK")
""")


def test_plugin_patch_works_without_runtime_plugin(tmp_path: Path):
    """The patched copy: --sp_strategy parses, CPU timing works, both Flux bugs are fixed and
    FLUX.2 / Qwen-Image take any text length (exact) and reject image padding, with the
    run-time plugin off (SWIFTFUSION_AUTOLOAD=0, nothing calls install())."""
    _patched_copy(tmp_path)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO), str(REPO / "tests")]),
               PYTHONDONTWRITEBYTECODE="1", SWIFTFUSION_AUTOLOAD="0", OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-c", _PLUGIN_SCRIPT, str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=400, cwd=tmp_path)
    assert res.returncode == 0 and "PLUGIN PATCH OK" in res.stdout, \
        res.stdout[-3000:] + res.stderr[-6000:]
