"""SGLang's own DiT model classes (tiny random configs: Flux) with their attention on our strategy: a
forward across 4 emulated ranks (2 machines x 2) equals the one-rank forward and SGLang's own USP
over the same ranks, with 0 fallbacks (every attention call of the model runs on the strategy)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from support import sglang_env

_reason = sglang_env.absent()
if _reason:
    pytest.skip(_reason, allow_module_level=True)

import torch.distributed as dist  # noqa: E402

from support import sglang_ranks  # noqa: E402
from xfuser_swiftfusion.emulation.launcher import run_emulated  # noqa: E402

HEADS, HEAD_DIM = 8, 16


def _randomize(model: torch.nn.Module) -> torch.nn.Module:
    """Every parameter from one seeded generator (the same on every rank), small values."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model.eval()


def _flux(rank: int, world: int, text_mode: str):
    """Flux: image tokens sharded; text sharded with them (SGLang's default) or replicated on
    every rank (``num_replicated_prefix``, SGLang's choice for short text)."""
    from sglang.multimodal_gen.configs.models.dits.flux import FluxArchConfig, FluxConfig
    from sglang.multimodal_gen.runtime.distributed import sp_shard_utils
    from sglang.multimodal_gen.runtime.models.dits.flux import FluxTransformer2DModel
    if text_mode == "replicated":
        sp_shard_utils._TEXT_SHARD_MIN = 1 << 30
    arch = FluxArchConfig(num_layers=1, num_single_layers=1, attention_head_dim=HEAD_DIM,
                          num_attention_heads=HEADS, in_channels=16, joint_attention_dim=32,
                          pooled_projection_dim=16, axes_dims_rope=(4, 6, 6))
    model = _randomize(FluxTransformer2DModel(FluxConfig(arch_config=arch), hf_config={}))
    g = torch.Generator().manual_seed(1)
    B, L, T = 1, 16, 8
    x, text = torch.randn(B, L, 16, generator=g), torch.randn(B, T, 32, generator=g)
    pooled = torch.randn(B, 16, generator=g)
    ids = torch.cat([torch.zeros(T, 3), torch.randint(0, 8, (L, 3), generator=g).float()])
    cos, sin = model.rotary_emb.forward(ids)
    S = L // world
    img = slice(T + rank * S, T + (rank + 1) * S)
    freqs = (torch.cat([cos[:T], cos[img]]), torch.cat([sin[:T], sin[img]]))
    return lambda: model(x[:, rank * S:(rank + 1) * S], text, pooled, torch.tensor([500.0]),
                         torch.tensor([3.5]), freqs_cis=freqs), 1


# Wan and Qwen-Image are not here yet: their CPU path calls sgl_kernel's CPU build
# (torch.ops.sgl_kernel.fused_scale_shift_cpu), which the --no-deps install lacks
FAMILIES = {"flux-text-sharded": (_flux, "sharded"), "flux-text-replicated": (_flux, "replicated")}


def _rank(family: str, strategy: str | None):
    from xfuser_swiftfusion.integrations import sglang as sfs
    sglang_ranks.setup()
    rank, world = dist.get_rank(), dist.get_world_size()
    make, mode = FAMILIES[family]
    forward, seq_dim = make(rank, world, mode)
    outs, stats = {}, {}
    with sglang_ranks.forward_context(), torch.no_grad():
        outs["sglang"] = forward()
        if strategy is not None:
            sfs.install(strategy)
            try:
                outs[strategy] = forward()
                stats = {h: (c.calls, c.stats()["fallbacks"]) for h, c in sfs.active().items()}
            finally:
                sfs.uninstall()
    sglang_ranks.teardown()
    return outs, stats, seq_dim


def emulate(family: str):
    """One rank's forward and 2x2's (runs in the SGLang child process)."""
    return (run_emulated(_rank, "1x1", family, None, timeout_s=120),
            run_emulated(_rank, "2x2", family, "swiftfusion", timeout_s=240))


@pytest.fixture(scope="module")
def runs():
    """Every family in one child process that imports SGLang (the pytest process does not)."""
    return dict(zip(FAMILIES, sglang_env.in_child([(Path(__file__).stem, "emulate", (f,))
                                                    for f in FAMILIES])))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_sglang_model_on_swiftfusion(runs, family):
    ((one, _, _),), per_rank = runs[family]
    seq_dim = per_rank[0][2]
    ref = one["sglang"]
    for who in ("sglang", "swiftfusion"):
        out = torch.cat([r[0][who] for r in per_rank], seq_dim)
        assert out.shape == ref.shape
        err = (out - ref).abs().max().item()
        assert err < 1e-4 * max(1.0, ref.abs().max().item()), f"{family} {who}: {err:.2e}"
    for rank, (_, stats, _) in enumerate(per_rank):
        assert stats, f"rank {rank}: no attention call reached the strategy"
        for heads, (calls, fallbacks) in stats.items():
            assert calls > 0 and fallbacks == {}, (family, rank, heads, calls, fallbacks)
