"""SGLang's own DiT model classes (tiny random configs: Flux, Qwen-Image, Wan) with their attention
on our strategy: a forward across 4 emulated ranks (2 machines x 2) equals the one-rank forward
and SGLang's own USP over the same ranks, every self- and joint attention call on the strategy.

Calls the strategies do not take run SGLang's path, counted and logged once; the models reach
two: Wan's cross-attention (``skip_sequence_parallel``: replicated text K/V, no exchange) and
Qwen-Image's sharded text, whose Ulysses exchange Qwen-Image runs itself before the attention
(``qkv_pre_all_to_all``). Both are asserted by count and log line. SGLang's CPU modulation ops
run on the test stand-ins of ``support.sgl_kernel_cpu``."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from support import sglang_env

_reason = sglang_env.absent()
if _reason:
    pytest.skip(_reason, allow_module_level=True)

import logging  # noqa: E402

import torch.distributed as dist  # noqa: E402

from support import sglang_ranks  # noqa: E402
from xfuser_swiftfusion.emulation.launcher import run_emulated  # noqa: E402

HEADS, HEAD_DIM = 8, 16
SKIP_SP = "skip_sequence_parallel layer (replicated K/V)"
PRE_A2A = "q/k/v already exchanged (qkv_pre_all_to_all)"


def _randomize(model: torch.nn.Module) -> torch.nn.Module:
    """Every parameter from one seeded generator (the same on every rank), small values."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model.eval()


def _replicate_text(text_mode: str) -> None:
    """SGLang shards joint text over SP ranks by default; below ``_TEXT_SHARD_MIN`` tokens it
    replicates it (``num_replicated_prefix``). Set in the rank process only."""
    from sglang.multimodal_gen.runtime.distributed import sp_shard_utils
    if text_mode == "replicated":
        sp_shard_utils._TEXT_SHARD_MIN = 1 << 30


def _flux(rank: int, world: int, text_mode: str):
    """Flux: image tokens ``[B, L, C]`` sharded by rows; text sharded with them or replicated."""
    from sglang.multimodal_gen.configs.models.dits.flux import FluxArchConfig, FluxConfig
    from sglang.multimodal_gen.runtime.models.dits.flux import FluxTransformer2DModel
    _replicate_text(text_mode)
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


def _qwen(rank: int, world: int, text_mode: str):
    """Qwen-Image: image tokens ``[B, L, C]`` sharded by rows, RoPE caches sharded as SGLang's
    pipeline config shards them; text sharded by the model or replicated."""
    from sglang.multimodal_gen.configs.models.dits.qwenimage import (
        QwenImageArchConfig,
        QwenImageDitConfig,
    )
    from sglang.multimodal_gen.configs.pipeline_configs.qwen_image import QwenImagePipelineConfig
    from sglang.multimodal_gen.runtime.models.dits.qwen_image import QwenImageTransformer2DModel
    _replicate_text(text_mode)
    arch = QwenImageArchConfig(num_layers=1, attention_head_dim=HEAD_DIM,
                               num_attention_heads=HEADS, in_channels=16, joint_attention_dim=32,
                               axes_dims_rope=(4, 6, 6))
    model = _randomize(QwenImageTransformer2DModel(QwenImageDitConfig(arch_config=arch),
                                                   hf_config={}))
    g = torch.Generator().manual_seed(1)
    h, w, T = 4, 4, 8
    L = h * w
    x, text = torch.randn(1, L, 16, generator=g), torch.randn(1, T, 32, generator=g)
    shapes = [[(1, h, w)]]
    (img_cache, txt_cache), (img_c, txt_c) = QwenImagePipelineConfig.get_freqs_cis(
        shapes, [T], model.rotary_emb, torch.device("cpu"), torch.float32)
    rows = slice(rank * (L // world), (rank + 1) * (L // world))
    return lambda: model(x[:, rows], text, None, torch.tensor([500.0]), img_shapes=shapes,
                         txt_seq_lens=[T], freqs_cis=(img_cache[rows], txt_cache),
                         freqs_complex=(img_c[rows], txt_c)), 1


def _wan(rank: int, world: int, _mode: str):
    """Wan: the latent video ``[B, C, F, H, W]`` sharded by frames (SGLang's RoPE offsets them by
    the SP rank); two blocks (the chained FFN residual), text by cross-attention."""
    from sglang.multimodal_gen.configs.models.dits.wanvideo import (
        WanVideoArchConfig,
        WanVideoConfig,
    )
    from sglang.multimodal_gen.runtime.models.dits.wanvideo import WanTransformer3DModel
    arch = WanVideoArchConfig(num_layers=2, num_attention_heads=HEADS, attention_head_dim=HEAD_DIM,
                              in_channels=16, out_channels=16, text_dim=32, freq_dim=32,
                              ffn_dim=64)
    model = _randomize(WanTransformer3DModel(WanVideoConfig(arch_config=arch), hf_config={}))
    g = torch.Generator().manual_seed(1)
    F = 4
    x, text = torch.randn(1, 16, F, 4, 4, generator=g), torch.randn(1, 8, 32, generator=g)
    f = F // world
    return lambda: model(x[:, :, rank * f:(rank + 1) * f], text, torch.tensor([500.0])), 2


# family: (model, text mode, fallbacks expected per rank {reason: calls})
FAMILIES = {
    "flux-text-sharded": (_flux, "sharded", {}),
    "flux-text-replicated": (_flux, "replicated", {}),
    "qwen-image-text-replicated": (_qwen, "replicated", {}),
    "qwen-image-text-sharded": (_qwen, "sharded", {}),
    "wan": (_wan, "", {SKIP_SP: 2}),
}
SLOW = {"qwen-image-text-sharded"}  # the path of flux-text-sharded, in Qwen-Image


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _rank(family: str, strategy: str | None):
    from xfuser_swiftfusion.integrations import sglang as sfs
    sglang_ranks.setup()
    rank, world = dist.get_rank(), dist.get_world_size()
    make, mode, _ = FAMILIES[family]
    forward, seq_dim = make(rank, world, mode)
    outs, stats, lines = {}, {}, _Lines()
    logging.getLogger("xfuser.swiftfusion").addHandler(lines)
    with sglang_ranks.forward_context(), torch.no_grad():
        outs["sglang"] = forward()
        if strategy is not None:
            sfs.install(strategy)
            try:
                outs[strategy] = forward()
                stats = {h: (c.calls, c.stats()["fallbacks"]) for h, c in sfs.active().items()}
            finally:
                sfs.uninstall()
    logging.getLogger("xfuser.swiftfusion").removeHandler(lines)
    sglang_ranks.teardown()
    return outs, stats, seq_dim, lines.lines


def emulate(family: str, strategy: str = "swiftfusion"):
    """One rank's forward and 2x2's (runs in the SGLang child process)."""
    return (run_emulated(_rank, "1x1", family, None, timeout_s=120),
            run_emulated(_rank, "2x2", family, strategy, timeout_s=240))


@pytest.fixture(scope="module")
def runs(sglang_child, request):
    """The families this run selects, in the session's SGLang child (one job each)."""
    wanted = sorted({item.callspec.params["family"] for item in request.session.items
                     if item.module is request.module and hasattr(item, "callspec")})
    jobs = [(Path(__file__).stem, "emulate", (f,)) for f in wanted]
    return dict(zip(wanted, sglang_child.run(jobs)))


@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.slow) if f in SLOW else f
                                    for f in FAMILIES])
def test_sglang_model_on_swiftfusion(runs, family):
    ((one, _, _, _),), per_rank = runs[family]
    expected = FAMILIES[family][2]
    seq_dim = per_rank[0][2]
    ref = one["sglang"]
    for who in ("sglang", "swiftfusion"):
        out = torch.cat([r[0][who] for r in per_rank], seq_dim)
        assert out.shape == ref.shape
        err = (out - ref).abs().max().item()
        assert err < 1e-5 * max(1.0, ref.abs().max().item()), f"{family} {who}: {err:.2e}"
    for rank, (_, stats, _, lines) in enumerate(per_rank):
        assert stats, f"rank {rank}: no attention call reached the strategy"
        for heads, (calls, fallbacks) in stats.items():
            assert calls > 0 or expected.get(PRE_A2A), (family, rank, heads, calls)
            assert fallbacks == expected, (family, rank, heads, fallbacks)
        # the fallback's one log line, on rank 0 only
        logged = [line for line in lines if "run SGLang's own path" in line]
        want = [f"SGLang attention calls with {r} run SGLang's own path (counted in "
                "stats()['fallbacks'])" for r in expected] if rank == 0 else []
        assert logged == want, (family, rank, logged)


def stand_ins():
    """SGLang's CPU modulation layers on the sgl_kernel stand-ins, and an independent torch
    reference (sglang's CPU test's formulas): max errors by case (runs in the SGLang child)."""
    import torch.nn.functional as F

    from sglang.multimodal_gen.runtime.layers import layernorm as ln
    from sglang.multimodal_gen.runtime.layers.elementwise import MulAdd
    from support import sgl_kernel_cpu
    sgl_kernel_cpu.install()
    B, S, C, frames, eps = 2, 6, 40, 3, 1e-6
    g = torch.Generator().manual_seed(2)

    def rnd(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g).to(dtype)

    def norm(kind, x32, layer):
        w = getattr(layer.norm, "weight", None)
        if kind == "rms":
            out = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + eps)
            return out if w is None else out * w
        return F.layer_norm(x32, (C,), w, getattr(layer.norm, "bias", None), eps)

    def wide(t):  # [B, C], [B, 1, C], [B, F, 1, C] -> broadcastable to [B, S, C]
        if t.dim() == 2:
            return t[:, None]
        if t.dim() == 4:
            return t.expand(-1, -1, S // t.shape[1], -1).reshape(t.shape[0], S, C)
        return t

    errs = {}
    for dtype in (torch.float32, torch.bfloat16):
        for kind, one, res in (
                ("layer", ln.LayerNormScaleShift, ln.ScaleResidualLayerNormScaleShift),
                ("rms", ln.RMSNormScaleShift, ln.ScaleResidualRMSNormScaleShift)):
            for shape in ((B, C), (B, 1, C), (B, frames, 1, C)):
                layer = one(C, eps=eps, elementwise_affine=True)
                rlayer = res(C, eps=eps, elementwise_affine=True)
                with torch.no_grad():
                    for p in (*layer.parameters(), *rlayer.parameters()):
                        p.copy_(rnd(*p.shape))
                x, r = rnd(B, S, C, dtype=dtype), rnd(B, S, C, dtype=dtype)
                scale, shift, gate = rnd(*shape), rnd(*shape), rnd(*shape)
                ref = ((norm(kind, x.float(), layer).to(dtype).float() * (1 + wide(scale))
                        + wide(shift)).to(dtype))
                errs[(str(dtype), kind, shape, "norm")] = (layer(x, shift, scale).float()
                                                           - ref.float()).abs().max().item()
                r_out = (r.float() + x.float() * wide(gate)).to(dtype)
                ref = ((norm(kind, r_out.float(), rlayer).to(dtype).float() * (1 + wide(scale))
                        + wide(shift)).to(dtype))
                out, r_got = rlayer(r, x, gate, shift, scale)
                errs[(str(dtype), kind, shape, "residual")] = max(
                    (out.float() - ref.float()).abs().max().item(),
                    (r_got.float() - r_out.float()).abs().max().item())
        # fuse_scale_shift_kernel's CPU path against MulAdd's own torch path (a * (k + b) + c)
        mul_add = MulAdd()
        from sglang.kernels.ops.diffusion import fuse_scale_shift_kernel
        x = rnd(B, S, C, dtype=dtype)
        for shape in ((B, 1, C), (B, frames, 1, C)):
            scale, shift = rnd(*shape, dtype=dtype), rnd(B, S, C, dtype=dtype)
            got = fuse_scale_shift_kernel(x, scale, shift, scale_constant=1.0)
            errs[(str(dtype), "scale-shift", shape)] = (
                got.float() - mul_add.forward_native(x, scale, shift, 1).float()).abs().max().item()
    return errs


def test_sgl_kernel_stand_ins(sglang_child):
    """The stand-ins give SGLang's CPU modulation layers the kernels' documented arithmetic: fp32
    exact to 1e-5; bf16 within one rounding step of the reference."""
    (errs,) = sglang_child.run([(Path(__file__).stem, "stand_ins", ())])
    assert len(errs) == 2 * (2 * 3 * 2 + 2)
    for case, err in errs.items():
        assert err < (1e-5 if "float32" in case[0] else 0.07), (case, err)
