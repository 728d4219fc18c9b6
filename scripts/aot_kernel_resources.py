"""Registers, spills, shared memory and tensor-core instructions of the Triton kernels, compiled
ahead of time (no GPU needed; ``triton_attend.aot_compile``, ``combine.aot_compile``).

For each head dim: every configuration the speed stage times on sm_90
(``kernel.SM90_CANDIDATES``, the table's entries among them) in the attention kernel's three
variants (not finalizing, finalizing, split along K/V), and the combine kernel. Prints a
markdown table with the triton version and the command line; occupancy is the blocks per SM
that registers and shared memory allow (65536 registers, 228 KiB per SM on sm_90) x warps / 64.

    python scripts/aot_kernel_resources.py                 # sm_90
    python scripts/aot_kernel_resources.py --arch 80       # sm_80 (A100: 164 KiB per SM)
"""
from __future__ import annotations

import argparse
import shlex
import sys

import torch
import triton

from xfuser_swiftfusion.kernels import combine
from xfuser_swiftfusion.kernels.triton_attend import KernelConfig, aot_compile, resource_usage
from xfuser_swiftfusion.tools.gpu_suite.kernel import SM90_CANDIDATES

SHARED_PER_SM = {80: 164 * 1024, 86: 100 * 1024, 90: 228 * 1024}
REGISTERS_PER_SM = 65536
MAX_WARPS_PER_SM = {80: 64, 86: 48, 90: 64}


def occupancy(arch: int, warps: int, registers: int, shared: int) -> float:
    """Resident warps / the SM's maximum, from registers (allocated per warp in units of 256)
    and shared memory (plus 1 KiB reserved per block)."""
    per_warp = -(-registers * 32 // 256) * 256
    by_regs = REGISTERS_PER_SM // (per_warp * warps)
    by_smem = SHARED_PER_SM[arch] // (shared + 1024) if shared else by_regs
    blocks = min(by_regs, by_smem, MAX_WARPS_PER_SM[arch] // warps)
    return blocks * warps / MAX_WARPS_PER_SM[arch]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, default=90)
    args = p.parse_args()
    print(f"command: python {shlex.join(sys.argv)}  (triton {triton.__version__}, sm_{args.arch})\n")
    print("| D | config (BM x BN, warps, stages) | variant | registers | spill bytes | shared KiB "
          "| occupancy | wgmma |")
    print("| ---: | --- | --- | ---: | ---: | ---: | ---: | --- |")
    for D in (128, 64, 32):
        for c in SM90_CANDIDATES[D]:
            cfg = KernelConfig(*c)
            for variant, kw in (("plain", {"finalize": False}), ("finalize", {"finalize": True}),
                                ("split", {"finalize": False, "split": True})):
                k = aot_compile(D, torch.bfloat16, args.arch, cfg=cfg, **kw)
                u = resource_usage(k)
                occ = occupancy(args.arch, cfg.num_warps, u["registers"], u["shared"])
                print(f"| {D} | {cfg.block_m}x{cfg.block_n}, {cfg.num_warps}, {cfg.num_stages} | {variant} "
                      f"| {u['registers']} | {u['stack']} | {u['shared'] / 1024:.0f} | {occ:.1%} "
                      f"| {'yes' if 'wgmma' in k.asm['ptx'] else 'no'} |", flush=True)
    for D in (32, 64, 72, 128, 256):
        for aligned in (True, False):
            u = resource_usage(combine.aot_compile(D, torch.bfloat16, torch.bfloat16, args.arch, True, False, aligned))
            occ = occupancy(args.arch, combine.NUM_WARPS, u["registers"], u["shared"])
            print(f"| {D} | combine, {combine.block_m(D, aligned)} rows, {combine.NUM_WARPS} warps "
                  f"| {'aligned' if aligned else 'unaligned'} | {u['registers']} | {u['stack']} "
                  f"| {u['shared'] / 1024:.0f} | {occ:.1%} | - |", flush=True)


if __name__ == "__main__":
    main()
