"""CPU benchmark of the kernels layer: ``attend`` over N KV chunks versus ONE fused CPU flash
attention call on the concatenated K/V (the best a single-device attention can do).

Variants, interleaved repetition by repetition (medians reported):
  sdpa      one ``_scaled_dot_product_flash_attention_for_cpu`` call on contiguous K/V
  1 call    one ``attend`` call given all N KV chunks (separate buffers), finalized
  N calls   N ``attend`` calls with one KV chunk each (ring pattern), the last finalizes

Q is one chunk of length L, the KV chunks split L evenly (Lq = Lk total = L), [B, H, L, D].
Prints a markdown table and the command line.

    python scripts/bench_kernels.py                       # full sweep (L 2k..16k, D 64/128)
    python scripts/bench_kernels.py --lengths 2048 4096   # shorter
"""
from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time

import torch

from xfuser_swiftfusion.kernels import attend, new_state, set_backend

_sdpa_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _timed(fn) -> tuple[float, float]:
    """(wall seconds, process CPU seconds summed over threads) of one call."""
    w0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w0, time.process_time() - c0


def bench_point(L: int, D: int, chunks: list[int], args) -> dict[str, tuple[float, float]]:
    """Median (wall, CPU) seconds per variant for sequence length L and head dim D."""
    dtype = getattr(torch, args.dtype)
    B, H, scale = args.batch, args.heads, D**-0.5
    q = torch.randn(B, H, L, D, dtype=dtype)
    k = torch.randn(B, H, L, D, dtype=dtype)
    v = torch.randn(B, H, L, D, dtype=dtype)
    split = {n: [(kc.clone(), vc.clone()) for kc, vc in zip(k.chunk(n, dim=2), v.chunk(n, dim=2))] for n in chunks}

    def one_call(n):
        return lambda: attend([q], split[n], [new_state(q)], scale=scale, finalize=True)

    def n_calls(n):
        def run():
            states = [new_state(q)]
            for pair in split[n][:-1]:
                attend([q], [pair], states, scale=scale)
            attend([q], split[n][-1:], states, scale=scale, finalize=True)

        return run

    variants = {"sdpa": lambda: _sdpa_cpu(q, k, v, dropout_p=0.0, is_causal=False, scale=scale)}
    for n in chunks:
        variants[f"1call-{n}"] = one_call(n)
        if n > 1:
            variants[f"ncalls-{n}"] = n_calls(n)
    for fn in variants.values():  # warm-up
        fn()
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    for _ in range(args.reps):
        for name, fn in variants.items():
            times[name].append(_timed(fn))
    return {name: tuple(statistics.median(x) for x in zip(*ts)) for name, ts in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    p.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    set_backend("cpu")
    torch.manual_seed(0)

    print(f"command: python {shlex.join(sys.argv)}")
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, B={args.batch} H={args.heads} {args.dtype}, "
          f"median of {args.reps} interleaved repetitions; wall ms (CPU ms = process time over all threads)\n")  # fmt: skip
    print("| L | D | KV chunks | sdpa | attend, 1 call | vs sdpa (wall / CPU) | attend, N calls | vs sdpa (wall / CPU) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")

    def cell(t):
        return f"{t[0] * 1e3:.1f} ({t[1] * 1e3:.1f})"

    def ratio(t, ref):
        return f"{t[0] / ref[0]:.3f} / {t[1] / ref[1]:.3f}"

    for D in args.dims:
        for L in args.lengths:
            t = bench_point(L, D, args.chunks, args)
            for n in args.chunks:
                one, many = t[f"1call-{n}"], t.get(f"ncalls-{n}", t[f"1call-{n}"])
                ref = t["sdpa"]
                print(f"| {L} | {D} | {n} | {cell(ref)} | {cell(one)} | {ratio(one, ref)} | {cell(many)} | {ratio(many, ref)} |", flush=True)


if __name__ == "__main__":
    main()
