"""SGLang's own USP against our strategies on SGLang's Flux model class, emulated cluster.

    python scripts/bench_sglang.py [--topology 2x2] [--rate-mbit 80] [--tokens 1024] [--reps 3]

Every rank builds SGLang's ``FluxTransformer2DModel`` (tiny random config: 8 heads x 64, one
double and one single block, text sharded with the image as SGLang does by default) and runs its
forward under SGLang's USP (Ulysses over all ranks: SGLang's Ring has no CPU backend) and with
``USPAttention`` hooked onto each strategy, the variants interleaved ``--reps`` times; the machines
are network namespaces joined by a ``--rate-mbit`` link (needs root). Prints the median forward
time (slowest rank) per variant, its ratio to SGLang's, the largest difference to SGLang's output
and the fallbacks. Imports SGLang the way the tests do (tests/support/sglang_env.py).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from support import sglang_env, sglang_ranks  # noqa: E402

VARIANTS = ("sglang-usp", "tas", "torus", "swiftfusion")


def _model(tokens: int):
    from sglang.multimodal_gen.configs.models.dits.flux import FluxArchConfig, FluxConfig
    from sglang.multimodal_gen.runtime.models.dits.flux import FluxTransformer2DModel
    arch = FluxArchConfig(num_layers=1, num_single_layers=1, attention_head_dim=64,
                          num_attention_heads=8, in_channels=16, joint_attention_dim=32,
                          pooled_projection_dim=16, axes_dims_rope=(16, 24, 24))
    model = FluxTransformer2DModel(FluxConfig(arch_config=arch), hf_config={})
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()


def _rank(tokens: int, reps: int):
    from xfuser_swiftfusion.integrations import sglang as sfs
    sglang_ranks.setup()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model(tokens)
    g = torch.Generator().manual_seed(1)
    T = 64
    x, text = torch.randn(1, tokens, 16, generator=g), torch.randn(1, T, 32, generator=g)
    pooled = torch.randn(1, 16, generator=g)
    ids = torch.cat([torch.zeros(T, 3), torch.randint(0, 64, (tokens, 3), generator=g).float()])
    cos, sin = model.rotary_emb.forward(ids)
    S = tokens // world
    img = slice(T + rank * S, T + (rank + 1) * S)
    freqs = (torch.cat([cos[:T], cos[img]]), torch.cat([sin[:T], sin[img]]))

    def forward():
        return model(x[:, rank * S:(rank + 1) * S], text, pooled, torch.tensor([500.0]),
                     torch.tensor([3.5]), freqs_cis=freqs)

    times = {v: [] for v in VARIANTS}
    outs, fallbacks = {}, {}
    with sglang_ranks.forward_context(), torch.no_grad():
        for rep in range(reps + 1):  # the first round warms up (contexts, plans) and is dropped
            for variant in VARIANTS:
                if variant != "sglang-usp":
                    sfs.install(variant)
                dist.barrier()
                t0 = time.perf_counter()
                out = forward()
                dist.barrier()
                if rep:
                    times[variant].append(time.perf_counter() - t0)
                outs[variant] = out
                if variant != "sglang-usp":
                    fallbacks[variant] = sum(sum(c.stats()["fallbacks"].values())
                                             for c in sfs.active().values())
                    sfs.uninstall()
    sglang_ranks.teardown()
    return times, outs, fallbacks


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--topology", default="2x2")
    ap.add_argument("--rate-mbit", type=float, default=80.0)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    reason = sglang_env.sglang()
    if reason:
        print(reason)
        return 1
    from xfuser_swiftfusion.emulation.launcher import run_emulated
    from xfuser_swiftfusion.emulation.netns import LinkSpec
    link = LinkSpec(args.rate_mbit) if args.rate_mbit > 0 else None
    per_rank = run_emulated(_rank, args.topology, args.tokens, args.reps, timeout_s=1800,
                            link=link)
    base = None
    print(f"SGLang Flux model class, {args.topology}, {args.rate_mbit:g} Mbit/s, "
          f"{args.tokens} image tokens, median of {args.reps}")
    print(f"{'variant':<12} {'median s':>9} {'vs SGLang':>9} {'max |diff|':>11} {'fallbacks':>9}")
    for variant in VARIANTS:
        slowest = [max(r[0][variant][i] for r in per_rank) for i in range(args.reps)]
        med = statistics.median(slowest)
        base = base or med
        diff = max((r[1][variant] - r[1]["sglang-usp"]).abs().max().item() for r in per_rank)
        fb = "-" if variant == "sglang-usp" else str(max(r[2][variant] for r in per_rank))
        print(f"{variant:<12} {med:>9.3f} {base / med:>8.2f}x {diff:>11.2e} {fb:>9}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
