"""GPU benchmark of the kernels layer (needs CUDA; prints a notice and exits otherwise).

For Q of length L against N KV chunks (separate buffers, Lk total = L), [B, H, L, D]:
  flash-concat  one flash_attn_func call on contiguous concatenated K/V (the lower bound)
  flash         attend(..., backend "flash"): K/V concatenated, one flash_attn_func + merge
  torch         attend(..., backend "torch"): K/V concatenated, one torch SDPA op + merge
  cudnn         attend(..., backend "cudnn"): K/V concatenated, one cuDNN attention op + merge
                (fp16/bf16, D <= 128 and a multiple of 8)
  triton        attend(..., backend "triton"): ONE fused multi-chunk launch (paper Alg. 2),
                D in {32, 64, 128} only; the launch configuration is printed per point
Each attend call is finalized. Tensors live in [B, L, H, D] buffers (flash-attn's layout);
attend gets [B, H, L, D] views of them. CUDA-event timing, medians of interleaved repetitions.

    python scripts/bench_kernels_gpu.py
    python scripts/bench_kernels_gpu.py --lengths 8192 32768 --dims 128 --heads 3
    python scripts/bench_kernels_gpu.py --lengths 2304 --dims 72 128 --heads 3   # small grids
"""
from __future__ import annotations

import argparse
import importlib.util
import shlex
import statistics
import sys

import torch

from xfuser_swiftfusion.kernels import attend, new_state, set_backend


def _cuda_ms(fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def bench_point(L: int, D: int, n: int, args, have_flash: bool) -> dict[str, float]:
    """Median milliseconds per variant."""
    dtype = getattr(torch, args.dtype)
    B, H, scale = args.batch, args.heads, D**-0.5
    q_bl, k_bl, v_bl = (torch.randn(B, L, H, D, dtype=dtype, device="cuda") for _ in range(3))  # [B, L, H, D]
    chunks = [(kc.clone(), vc.clone()) for kc, vc in zip(k_bl.chunk(n, dim=1), v_bl.chunk(n, dim=1))]
    q = q_bl.transpose(1, 2)  # [B, L, H, D] -> [B, H, L, D]
    kv = [(kc.transpose(1, 2), vc.transpose(1, 2)) for kc, vc in chunks]  # [B, Lk, H, D] -> [B, H, Lk, D]

    def with_backend(name):
        def run():
            set_backend(name)
            attend([q], kv, [new_state(q)], scale=scale, finalize=True)

        return run

    variants = {"torch": with_backend("torch")}
    if dtype != torch.float32 and D % 8 == 0 and D <= 128 and torch.backends.cudnn.is_available():
        variants["cudnn"] = with_backend("cudnn")
    if D in (32, 64, 128):
        variants["triton"] = with_backend("triton")
    if have_flash and D % 8 == 0 and D <= 256 and dtype != torch.float32:
        from flash_attn import flash_attn_func

        variants["flash"] = with_backend("flash")
        variants["flash-concat"] = lambda: flash_attn_func(q_bl, k_bl, v_bl, softmax_scale=scale)
    for fn in variants.values():  # warm-up (and JIT compile)
        fn()
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.reps):
        for name, fn in variants.items():
            times[name].append(_cuda_ms(fn))
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 65536])
    p.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=24)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_kernels_gpu.py needs a CUDA GPU; none is available here.")
        return
    have_flash = importlib.util.find_spec("flash_attn") is not None
    print(f"command: python {shlex.join(sys.argv)}")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, B={args.batch} H={args.heads} {args.dtype}, "
          f"median of {args.reps}; flash-attn {'present' if have_flash else 'MISSING'}\n")  # fmt: skip
    from xfuser_swiftfusion.kernels.triton_attend import _device_info, pick_config

    sm, sms = _device_info(torch.cuda.current_device())
    print("| L | D | KV chunks | triton config | triton (ms) | TFLOP/s | cudnn (ms) | flash (ms) "
          "| torch (ms) | flash-concat (ms) | triton / concat |")  # fmt: skip
    print("|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    nan = float("nan")
    for D in args.dims:
        for L in args.lengths:
            for n in args.chunks:
                t = bench_point(L, D, n, args, have_flash)
                tri, concat = t.get("triton", nan), t.get("flash-concat", nan)
                tflops = 4 * args.batch * args.heads * L * L * D / (tri * 1e-3) / 1e12
                cfg = "-"
                if D in (32, 64, 128):
                    c = pick_config(D, sm, [L], args.batch * args.heads, sms)
                    cfg = f"{c.block_m}x{c.block_n} w{c.num_warps} s{c.num_stages}"
                print(f"| {L} | {D} | {n} | {cfg} | {tri:.3f} | {tflops:.0f} | {t.get('cudnn', nan):.3f} "
                      f"| {t.get('flash', nan):.3f} "
                      f"| {t['torch']:.3f} | {concat:.3f} | {tri / concat:.3f} |", flush=True)  # fmt: skip
    set_backend(None)


if __name__ == "__main__":
    main()
