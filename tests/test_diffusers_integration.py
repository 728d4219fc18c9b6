"""diffusers' own context parallelism with SwiftFusion strategies (``integrations.diffusers``).

Every diffusers 0.42 model with a ``_cp_plan`` is built as a tiny random-weight config; its
single-device forward (plain diffusers, before anything is enabled) is the reference. Two
emulated launches of 4 ranks (2 machines x 2 GPUs) run every model under every strategy:
4 heads (mesh U4xR1: torus 2 x intra-Ulysses 2) and 2 heads (U2xR2: a ring of 2 inside each
machine). fp32 whole-transformer outputs must match within ``TOL``.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

diffusers = pytest.importorskip("diffusers")
from diffusers import (ChronoEditTransformer3DModel, ContextParallelConfig,  # noqa: E402
                       Flux2Transformer2DModel, FluxTransformer2DModel,
                       HeliosTransformer3DModel, LTX2VideoTransformer3DModel,
                       LTXVideoTransformer3DModel, MiniMaxH3Transformer3DModel,
                       QwenImageTransformer2DModel, WanTransformer3DModel)
from diffusers.models.attention_dispatch import (_AttentionBackendRegistry,  # noqa: E402
                                                 dispatch_attention_fn)

from xfuser_swiftfusion.emulation.launcher import run_emulated  # noqa: E402
from xfuser_swiftfusion.integrations import diffusers as sfd  # noqa: E402
from xfuser_swiftfusion.integrations.diffusers import routing, sharding  # noqa: E402

STRATEGIES = ("tas", "torus", "swiftfusion", "auto")
TOL = 1e-5          # fp32, whole transformer output (measured <= 9e-7)
LAUNCHES = {"U4xR1": ("2x2", 4), "U2xR2": ("2x2", 2)}


# ---------------------------------------------------------------------------------------------
# tiny models: (model, inputs); every sharded length is a multiple of 4 ranks
# ---------------------------------------------------------------------------------------------

def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(1)


def flux(heads: int):
    """Text (8) and image (16) tokens both sharded: rank i holds [text_i, image_i]; batch 2."""
    g, side, text = _gen(), 4, 8
    axis = torch.arange(side).float()
    ids = torch.cartesian_prod(torch.zeros(1), axis, axis)
    model = FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                   attention_head_dim=8, num_attention_heads=heads,
                                   joint_attention_dim=16, pooled_projection_dim=8,
                                   axes_dims_rope=(2, 2, 4))
    return model, dict(hidden_states=torch.randn(2, side * side, 4, generator=g),
                       encoder_hidden_states=torch.randn(2, text, 16, generator=g),
                       pooled_projections=torch.randn(2, 8, generator=g),
                       timestep=torch.tensor([0.5, 0.7]), img_ids=ids, txt_ids=torch.zeros(text, 3))


def flux2(heads: int):
    """Text (8) and image (16) sharded; 4-axis ids (t, h, w, l)."""
    g, side, text = _gen(), 4, 8
    one, axis = torch.arange(1), torch.arange(side)
    img = torch.cartesian_prod(one, axis, axis, one)
    txt = torch.cartesian_prod(one, one, one, torch.arange(text))
    model = Flux2Transformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                    attention_head_dim=16, num_attention_heads=heads,
                                    joint_attention_dim=16, timestep_guidance_channels=32,
                                    axes_dims_rope=(4, 4, 4, 4))
    return model, dict(hidden_states=torch.randn(1, side * side, 4, generator=g),
                       encoder_hidden_states=torch.randn(1, text, 16, generator=g),
                       img_ids=img[None], txt_ids=txt[None], timestep=torch.tensor([0.5]),
                       guidance=torch.tensor([1.0]))


def _wan_like(cls, heads: int):
    """Video (2 x 4 x 4 patches) sharded; text (6) replicated, read by cross-attention only."""
    g = _gen()
    model = cls(patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=8,
                in_channels=4, out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2,
                rope_max_seq_len=32)
    return model, dict(hidden_states=torch.randn(1, 4, 2, 8, 8, generator=g),
                       timestep=torch.tensor([500]),
                       encoder_hidden_states=torch.randn(1, 6, 16, generator=g))


def wan(heads: int):
    return _wan_like(WanTransformer3DModel, heads)


def chronoedit(heads: int):
    return _wan_like(ChronoEditTransformer3DModel, heads)


def qwenimage(heads: int, text_mask: bool = False):
    """Text (8) and image (16) sharded; ``text_mask``: the last 3 text tokens are padding
    (a key mask on the joint self-attention: the all-gathered path)."""
    g, text = _gen(), 8
    model = QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=2,
                                        attention_head_dim=16, num_attention_heads=heads,
                                        joint_attention_dim=16, axes_dims_rope=(8, 4, 4))
    inputs = dict(hidden_states=torch.randn(1, 16, 16, generator=g),
                  encoder_hidden_states=torch.randn(1, text, 16, generator=g),
                  timestep=torch.tensor([0.5]), img_shapes=[(1, 4, 4)])
    if text_mask:
        inputs["encoder_hidden_states_mask"] = (torch.arange(text) < text - 3)[None]
    return model, inputs


def qwenimage_masked(heads: int):
    return qwenimage(heads, text_mask=True)


def ltx(heads: int):
    """Video (32) and text (8, last 3 padding) sharded: the text cross-attention has another
    length and a key mask (the all-gathered path)."""
    g, frames, side, text = _gen(), 2, 4, 8
    model = LTXVideoTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=heads,
                                       attention_head_dim=8, cross_attention_dim=8 * heads,
                                       num_layers=1, caption_channels=16)
    return model, dict(hidden_states=torch.randn(1, frames * side * side, 4, generator=g),
                       encoder_hidden_states=torch.randn(1, text, 16, generator=g),
                       timestep=torch.tensor([500]),
                       encoder_attention_mask=(torch.arange(text) < text - 3).float()[None],
                       num_frames=frames, height=side, width=side)


def ltx2(heads: int):
    """Video (32) sharded, audio (8) replicated: audio self-attention and audio<->video
    cross-attention see every replicated key once per rank (an exact softmax)."""
    g, frames, side, text, audio = _gen(), 2, 4, 8, 8
    model = LTX2VideoTransformer3DModel(
        in_channels=4, out_channels=4, patch_size=1, patch_size_t=1, num_attention_heads=heads,
        attention_head_dim=8, cross_attention_dim=8 * heads, audio_in_channels=4,
        audio_out_channels=4, audio_num_attention_heads=heads, audio_attention_head_dim=4,
        audio_cross_attention_dim=4 * heads, num_layers=1, caption_channels=16,
        rope_double_precision=False)
    return model, dict(hidden_states=torch.randn(1, frames * side * side, 4, generator=g),
                       audio_hidden_states=torch.randn(1, audio, 4, generator=g),
                       encoder_hidden_states=torch.randn(1, text, 16, generator=g),
                       audio_encoder_hidden_states=torch.randn(1, text, 16, generator=g),
                       timestep=torch.tensor([500.0]),
                       encoder_attention_mask=torch.ones(1, text).bool(), num_frames=frames,
                       height=side, width=side, audio_num_frames=audio, fps=25.0)


def minimax_h3(heads: int):
    """One packed sequence: text 4 + audio 4 + video 8 rows, sharded at the first block."""
    g, nt, na, nv = _gen(), 4, 4, 8
    length = nt + na + nv
    text, audio, video = torch.arange(nt), torch.arange(nt, nt + na), torch.arange(nt + na, length)
    tags = torch.zeros(length, dtype=torch.long)
    tags[text], tags[audio] = 1, 2
    steps = torch.zeros(length, dtype=torch.long)
    steps[audio] = 1
    pos = torch.zeros(length, 3)
    pos[:, 0] = torch.arange(length).float()
    pos[video, 1], pos[video, 2] = (torch.arange(nv) % 4).float(), (torch.arange(nv) % 2).float()
    model = MiniMaxH3Transformer3DModel(
        num_attention_heads=heads, attention_head_dim=16, hidden_size=24, num_layers=2,
        num_refiner_layers=1, ffn_dim=32, in_channels=4, audio_in_channels=6,
        patch_size=(1, 2, 2), text_dim=8, freq_dim=8, time_embed_hidden_dim=24,
        time_embed_dim=16, rope_freq_dim=2)
    return model, dict(hidden_states=torch.randn(1, nv, 16, generator=g),
                       audio_hidden_states=torch.randn(1, na, 6, generator=g),
                       encoder_hidden_states=torch.randn(1, nt, 8, generator=g),
                       timestep=torch.tensor([0.7, 0.3]), timestep_indices=steps, token_tags=tags,
                       position_ids=pos, video_indices=video, audio_indices=audio,
                       text_indices=text)


def helios(heads: int):
    """40 layers (its plan names blocks 0..39); 128 current + 64 + 16 + 4 history tokens."""
    g, c, frames, side = _gen(), 4, 2, 16
    model = HeliosTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=heads,
                                     attention_head_dim=12, in_channels=c, out_channels=c,
                                     text_dim=16, freq_dim=32, ffn_dim=32, num_layers=40,
                                     rope_dim=(4, 4, 4))
    hist = (frames - 1, frames - 1, (frames - 1) * 4)
    return model, dict(
        hidden_states=torch.randn(1, c, frames, side, side, generator=g),
        timestep=torch.tensor([500]), encoder_hidden_states=torch.randn(1, 12, 16, generator=g),
        indices_hidden_states=torch.ones(1, frames),
        indices_latents_history_short=torch.ones(1, hist[0]),
        indices_latents_history_mid=torch.ones(1, hist[1]),
        indices_latents_history_long=torch.ones(1, hist[2]),
        latents_history_short=torch.randn(1, c, hist[0], side, side, generator=g),
        latents_history_mid=torch.randn(1, c, hist[1], side, side, generator=g),
        latents_history_long=torch.randn(1, c, hist[2], side, side, generator=g))


MODELS = {"flux": flux, "flux2": flux2, "wan": wan, "chronoedit": chronoedit,
          "qwenimage": qwenimage, "qwenimage+mask": qwenimage_masked, "ltx": ltx, "ltx2": ltx2,
          "minimax_h3": minimax_h3, "helios": helios}
# diffusers' own Ulysses fails on these (0.42.1): a [B, H, 1, T] text mask meets H / W heads
# after the all-to-all; LTX-2 also lacks cross_attn_rope in its plan
DIFFUSERS_OWN_FAILS = {"ltx", "ltx2"}
ALL_GATHERED = {"qwenimage+mask"}


def build(name: str, heads: int):
    torch.manual_seed(0)
    model, inputs = MODELS[name](heads)
    for p in model.parameters():  # zero-initialised gates and tables would hide the attention
        if not p.abs().max():
            torch.nn.init.normal_(p, std=0.5)
    return model.eval(), inputs


def _forward(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs, return_dict=False)[0]


# ---------------------------------------------------------------------------------------------
# what every rank runs
# ---------------------------------------------------------------------------------------------

def _op_checks(model) -> dict:
    """Routed ``dispatch_attention_fn`` calls against full-sequence SDPA: grouped-query heads
    (strategy), a key-padding mask (all-gathered path), causal (refused)."""
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    config = model._parallel_config
    B, L, H, D = 2, 8 * world, sfd.context_of(model).num_heads, 8
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(B, L, H, D, generator=g) for _ in range(3))
    k, v = k[:, :, :H // 2], v[:, :, :H // 2]
    mask = torch.rand(B, L, generator=g) > 0.3
    part = slice(rank * L // world, (rank + 1) * L // world)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def full(m=None):
        ref = sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                   attn_mask=None if m is None else m[:, None, None, :], enable_gqa=True)
        return ref.transpose(1, 2)[:, part]

    ctx = sfd.context_of(model)
    before = dict(ctx.fallbacks)
    out = {}
    with torch.no_grad():
        got = dispatch_attention_fn(q[:, part], k[:, part], v[:, part], enable_gqa=True,
                                    parallel_config=config)
        out["gqa"] = (got - full()).abs().max().item()
        got = dispatch_attention_fn(q[:, part], k[:, part], v[:, part], attn_mask=mask[:, part],
                                    enable_gqa=True, parallel_config=config)
        out["mask"] = (got - full(mask)).abs().max().item()
        try:
            dispatch_attention_fn(q[:, part], k[:, part], v[:, part], is_causal=True,
                                  enable_gqa=True, parallel_config=config)
            out["causal"] = "ran"
        except routing.UnsupportedAttention as exc:
            out["causal"] = str(exc)
    out["fallbacks"] = {r: n - before.get(r, 0) for r, n in ctx.fallbacks.items()}
    return out


def _rank_run(heads: int) -> dict:
    import torch.distributed as dist
    world = dist.get_world_size()
    res: dict = {"errors": {}, "calls": {}, "mesh": {}, "fallbacks": {}, "own": {}}
    for name in MODELS:
        model, inputs = build(name, heads)
        ref = _forward(model, inputs)
        for strategy in STRATEGIES:
            ctx = sfd.enable_parallelism(model, strategy)
            try:
                out = _forward(model, inputs)
                stats = ctx.stats()
                if name == "flux" and strategy == "tas":
                    res["ops"] = _op_checks(model)
            finally:
                sfd.disable_parallelism(model)
            res["errors"][name, strategy] = (out - ref).abs().max().item()
            res["calls"][name, strategy] = stats["calls"]
            res["fallbacks"][name, strategy] = stats["fallbacks"]
            res["mesh"][name, strategy] = ctx.mesh.describe()
        res["errors"][name, "disabled"] = (_forward(model, inputs) - ref).abs().max().item()
        if heads % world == 0 and name not in DIFFUSERS_OWN_FAILS:
            # the harness's sanity: diffusers' own Ulysses over the same ranks, then adopted
            with sharding.accelerator_count_at_least_one():
                model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))
            res["own"][name, "diffusers"] = (_forward(model, inputs) - ref).abs().max().item()
            ctx = sfd.enable_parallelism(model, "swiftfusion")
            res["own"][name, "adopted"] = (_forward(model, inputs) - ref).abs().max().item()
            res["own"][name, "adopted-calls"] = ctx.stats()["calls"]
            sfd.disable_parallelism(model)
            res["own"][name, "diffusers-again"] = (_forward(model, inputs) - ref).abs().max().item()
    res["registry_restored"] = not any(hasattr(fn, routing._WRAPPED_ATTR)
                                       for fn in _AttentionBackendRegistry._backends.values())
    model, inputs = build("flux", heads)
    inputs = dict(inputs, encoder_hidden_states=inputs["encoder_hidden_states"][:, :7],
                  txt_ids=inputs["txt_ids"][:7])
    sfd.enable_parallelism(model, "torus")
    try:
        _forward(model, inputs)
        res["uneven"] = "ran"
    except ValueError as exc:
        res["uneven"] = str(exc)
    finally:
        sfd.disable_parallelism(model)
    return res


_launches: dict = {}


def launch(mesh: str) -> list[dict]:
    """Per-rank results of one emulated launch (run once per mesh, on first use)."""
    if mesh not in _launches:
        topology, heads = LAUNCHES[mesh]
        _launches[mesh] = run_emulated(_rank_run, topology, heads, timeout_s=600)
    return _launches[mesh]


# ---------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mesh", list(LAUNCHES))
@pytest.mark.parametrize("name", list(MODELS))
def test_every_strategy_matches_single_device(mesh, name):
    ranks = launch(mesh)
    for strategy in STRATEGIES:
        errs = [r["errors"][name, strategy] for r in ranks]
        assert max(errs) <= TOL, (name, strategy, errs)
        assert ranks[0]["mesh"][name, strategy].startswith(mesh), ranks[0]["mesh"][name, strategy]
        # every attention of the masked Qwen-Image runs the all-gathered path
        assert (ranks[0]["calls"][name, strategy] > 0) != (name in ALL_GATHERED), \
            (name, strategy, ranks[0]["calls"][name, strategy])
    assert max(r["errors"][name, "disabled"] for r in ranks) == 0.0  # disable restores the model


@pytest.mark.parametrize("mesh", list(LAUNCHES))
def test_only_masks_and_other_lengths_leave_the_strategy(mesh):
    ranks = launch(mesh)
    for (name, strategy), fallbacks in ranks[0]["fallbacks"].items():
        expected = {"ltx": {"an attention mask"}, "ltx2": {"an attention mask"},
                    "qwenimage+mask": {"an attention mask"}}.get(name, set())
        assert set(fallbacks) == expected, (name, strategy, fallbacks)


def test_diffusers_own_context_parallelism_matches_and_is_adopted():
    own = launch("U4xR1")[0]["own"]
    names = [n for n in MODELS if n not in DIFFUSERS_OWN_FAILS]
    for name in names:
        assert own[name, "diffusers"] <= TOL, (name, own[name, "diffusers"])
        assert own[name, "adopted"] <= TOL, (name, own[name, "adopted"])
        assert (own[name, "adopted-calls"] > 0) != (name in ALL_GATHERED)
        assert own[name, "diffusers-again"] <= TOL  # disable leaves diffusers' own CP on


@pytest.mark.parametrize("mesh", list(LAUNCHES))
def test_grouped_query_masks_and_causal_at_the_dispatch(mesh):
    ops = launch(mesh)[0]["ops"]
    assert ops["gqa"] <= TOL and ops["mask"] <= TOL, ops
    assert "causal" in ops["causal"], ops["causal"]
    assert ops["fallbacks"] == {"an attention mask": 1}, ops["fallbacks"]


def test_registry_restored_and_uneven_lengths_named():
    for rank in launch("U4xR1"):
        assert rank["registry_restored"]
        assert "not divisible by 4" in rank["uneven"] and "<model>: txt_ids" in rank["uneven"], \
            rank["uneven"]


def test_fallback_reasons():
    q = torch.zeros(1, 8, 4, 2)
    base = dict(query=q, key=q, value=q, attn_mask=None, dropout_p=0.0, is_causal=False,
                scale=None, enable_gqa=False, _parallel_config=None)
    assert routing.fallback_reason(base, 4) is None
    assert routing.fallback_reason(dict(base, key=q[:, :3], value=q[:, :3]), 4).startswith("query")
    assert routing.fallback_reason(dict(base, attn_mask=torch.ones(1, 8)), 4) == "an attention mask"
    assert routing.fallback_reason(dict(base, key=q[:, :, :2]), 4) is None   # GQA runs
    assert "heads" in routing.fallback_reason(base, 8)
    assert routing.fallback_reason(dict(base, return_lse=True), 4) == "return_lse=True"
    with pytest.raises(routing.UnsupportedAttention, match="causal"):
        routing.fallback_reason(dict(base, is_causal=True), 4)


def test_strategies_that_need_xfuser_groups_are_refused():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="xFuser's process groups"):
        sfd.enable_parallelism(model, "usp")
    with pytest.raises(ValueError, match="unknown strategy"):
        sfd.enable_parallelism(model, "nope")


def test_importing_the_integration_imports_no_diffusers():
    code = ("import sys; import xfuser_swiftfusion.integrations.diffusers; "
            "print([m for m in ('diffusers', 'xfuser') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr[-2000:]


@pytest.mark.parametrize("example,strategy", [("diffusers_flux_example.py", "swiftfusion"),
                                              ("diffusers_wan_example.py", "torus")])
def test_diffusers_example_runs_as_the_readme_says(example, strategy):
    """The README's CPU commands for the diffusers examples (own process, --emulate 2x2): the
    strategy runs every attention call without a fallback and the latents equal the
    single-device run; no per-rank warnings in the output."""
    from pathlib import Path
    script = Path(__file__).resolve().parents[1] / "examples" / example
    res = subprocess.run([sys.executable, str(script), "--emulate", "2x2", "--strategy", strategy,
                          "--steps", "2"], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout + res.stderr
    assert f"strategy {strategy}" in out and "fallbacks [{}]" in out, out[-3000:]
    err = float(re.search(r"max \|latents - single device\|: ([0-9.e+-]+)", out).group(1))
    assert err < 1e-4, out[-3000:]
    assert "FutureWarning" not in out, out[-3000:]
