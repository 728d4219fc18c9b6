"""Which schedule the supported models' head counts get on N x 8 GPUs: a markdown table.

For each head count (models sharing head count and head dim share a row) and each cluster
``N x 8`` (N = 2, 3, 4, 8 by default): the default mesh ``gcd(8N, H)``, what ``torus`` and
``swiftfusion`` run there (the Torus schedule as is, on zero-padded heads ``H -> H'`` where the
default mesh is not torus-ready, or the ``tas`` fallback where no ``H' <= 2H`` fits), the cost
of the padding (``H'/H`` compute and bytes), inter-machine MB per GPU per attention layer and
the cost model's predicted latency per layer (``swiftfusion`` as it runs, ``tas``, ``usp``;
one layer of B=1, L tokens, bf16, on the ``--hardware`` profile: a prediction, not a
measurement).

Head counts: the ``num_attention_heads`` of each model's diffusers transformer config.
``verified`` says where this repository's environment confirms it (the installed diffusers
class defaults, which are the named checkpoint's config); the others come from the
checkpoints' published configs, not available offline here.

Command: .venv/bin/python scripts/plan_models.py [--nodes 2,3,4,8] [--seq-len 24576]
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from xfuser_swiftfusion.mesh import choose_mesh
from xfuser_swiftfusion.tools.cli import plan
from xfuser_swiftfusion.topology import Topology


@dataclass(frozen=True)
class Model:
    name: str
    heads: int
    head_dim: int
    verified: str  # where the head count is confirmed here ("" = not verifiable offline)


MODELS = (
    Model("Flux", 24, 128, "diffusers FluxTransformer2DModel defaults"),
    Model("Wan 14B", 40, 128, "diffusers WanTransformer3DModel defaults (the 14B config)"),
    Model("Wan 1.3B", 12, 128, ""),
    Model("SD3.5 Large", 38, 64, ""),
    Model("SD3.5 Medium", 24, 64, ""),
    Model("HunyuanVideo", 24, 128, "diffusers HunyuanVideoTransformer3DModel defaults"),
    Model("CogVideoX 5B", 48, 64, ""),
    Model("CogVideoX 2B", 30, 64, "diffusers CogVideoXTransformer3DModel defaults (the 2B config)"),
    Model("Qwen-Image", 24, 128, "diffusers QwenImageTransformer2DModel defaults"),
    Model("Lumina2", 24, 96, "diffusers Lumina2Transformer2DModel defaults (8 K/V heads, "
                             "hidden 2304 / 24 heads)"),
    Model("FLUX.2", 48, 128, "diffusers Flux2Transformer2DModel defaults"),
)


def rows(nodes: list[int], gpus: int, seq_len: int, hardware: str) -> list[str]:
    """Markdown rows, one per (head count and head dim, machines)."""
    groups: dict[tuple[int, int], list[str]] = {}
    for m in MODELS:
        groups.setdefault((m.heads, m.head_dim), []).append(m.name)
    out = []
    for (H, D), names in sorted(groups.items()):
        for n in nodes:
            topo = Topology(n, gpus)
            if seq_len % topo.world_size:
                raise SystemExit(f"--seq-len {seq_len} is not divisible by {topo.world_size} GPUs")
            default = choose_mesh(topo, H, "tas")
            p = plan(n, gpus, H, seq_len, D, hardware=hardware)
            sf = p["swiftfusion"]
            mesh = f"U{sf['ulysses_degree']}xR{sf['ring_degree']}"
            if sf["runs_as"] != "swiftfusion":
                runs = f"{sf['runs_as']} (no H' <= {2 * H} fits)"
            elif sf["heads"] != H:
                runs = f"Torus, padded {H} -> {sf['heads']}, {mesh}"
            else:
                runs = f"Torus, {mesh}"
            strats = [x for x in ("swiftfusion", "tas", "usp") if x in p]
            mb = " / ".join(f"{p[x]['inter_node_bytes_per_gpu'] / 1e6:.1f}" for x in strats)
            ms = " / ".join(f"{p[x]['predicted_latency_s'] * 1e3:.2f}" for x in strats)
            ready = "" if default.torus_ready else " (ring crosses machines)"
            out.append(f"| {', '.join(names)} | {H} | {D} | {n}x{gpus} | "
                       f"U{default.ulysses}xR{default.ring}{ready} | {runs} | "
                       f"{sf['heads'] / H:.3g}x | {mb} | {ms} |")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", default="2,3,4,8", help="machine counts, comma-separated")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=24576,
                    help="global tokens of the modelled layer (divisible by every GPU count)")
    ap.add_argument("--hardware", default="p4de", metavar="NAME|PATH",
                    help="cost-model profile: built in (default p4de) or a file from swiftfusion calibrate")
    args = ap.parse_args(argv)
    nodes = [int(x) for x in args.nodes.split(",") if x.strip()]
    print(f"Torus schedule per model head count on N x {args.gpus_per_node} GPUs "
          f"(one attention layer, B=1, L={args.seq_len}, bf16; predicted on {args.hardware})\n")
    print("| models | H | D | cluster | default mesh | torus / swiftfusion run | compute, bytes "
          "| inter-machine MB/GPU: swiftfusion / tas / usp | predicted ms: swiftfusion / tas / usp |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows(nodes, args.gpus_per_node, args.seq_len, args.hardware)))
    print("\nHead counts confirmed here: " + "; ".join(
        f"{m.name} {m.heads} ({m.verified})" for m in MODELS if m.verified)
        + ". Not verifiable offline (published checkpoint configs): "
        + ", ".join(f"{m.name} {m.heads}" for m in MODELS if not m.verified) + ".")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
