"""Triton backend: the fused multi-chunk attention kernel of the paper (Algorithm 2).

One launch computes every Q chunk against every KV chunk and merges into the running states:

* grid = (sum_i ceil(Lq_i / BLOCK_M), B, H); program (x, b, h) owns one Q tile of one chunk,
  found through the exclusive prefix sum ``cQO`` of tile counts stored in the chunk table;
* it loads the Q tile and the running (m, l) of its rows, loops over all KV chunks and their
  BLOCK_N tiles with the online softmax, merges the running acc (one rescale, in the
  epilogue) and stores the state back; when finalizing it also stores acc / l in the query
  dtype (rows with l == 0 output 0).

Grouped-query attention: K/V chunks ``[B, H_kv, Lk, D]`` (H_kv dividing H) are read in place,
query head h reading K/V head ``h // REP`` (``REP = H / H_kv``, a compile-time constant: one
kernel variant per ratio, the ``REP = 1`` one identical to plain multi-head attention).

Chunks live in different buffers, so the kernel receives one int64 table of raw addresses and
element strides (layout next to ``NQF`` / ``NKF``) and casts addresses to typed pointers
in the kernel. Tensors are [B, H, L, D] views with unit stride along D, 16-byte aligned, and
B/H/L strides that are multiples of 8 elements (inputs that are not are copied first).

Numerics: ``m`` stays in natural-log units (as stored by every backend) and exponentials are
exp2 of scale * log2(e) * score - m * log2(e). Under ``TRITON_INTERPRET=1``
(CPU tensors, used by the tests) tiles are upcast to fp32 because the interpreter gets bf16
arithmetic wrong.
"""
from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from .combine import TL_DTYPES, CombinePlan, compile_for, split_count
from .combine import row_ptrs as _rows  # fp32 pointers to rows of a [B, H, L] table tensor
from .graph_tables import device_table
from .interpret import interpreting
from .state import AttnState, finalize

# Chunk tables (int64). A Q-chunk row holds five groups (address, stride_b, stride_h,
# stride_l) for Q, acc, m, l and the output, then Lq and the chunk's first tile (its cQO);
# a KV-chunk row holds the groups of K and V, then Lk and the chunk's first K/V tile (the
# exclusive prefix sum of BLOCK_N tiles: the split-K/V ranges). Strides are in elements.
F_Q, F_ACC, F_M, F_L, F_O = (tl.constexpr(4 * g) for g in range(5))
F_LQ, F_TILE0, NQF = tl.constexpr(20), tl.constexpr(21), tl.constexpr(22)
F_K, F_V, F_LK, F_KTILE0, NKF = (tl.constexpr(x) for x in (0, 4, 8, 9, 10))

LOG2E = tl.constexpr(1.4426950408889634)
SUPPORTED_HEAD_DIMS = (32, 64, 128)


@triton.jit
def _tile(row, FIELD: tl.constexpr, ELEM: tl.constexpr, b, h, start, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Pointers [BLOCK, HEAD_DIM] to rows [start, start + BLOCK) of [b, h] of the [B, H, L, D]
    tensor at ``row[FIELD:]``: a 16-byte aligned scalar base plus int32 offsets (the launcher
    guarantees the alignment, B/H/L strides that are multiples of 8 elements, and BLOCK * L
    stride < 2**31), so that loads vectorise and pipeline."""
    stride_l = tl.load(row + FIELD + 3)
    base = tl.load(row + FIELD).to(tl.pointer_type(ELEM))
    base = tl.multiple_of(base + b * tl.load(row + FIELD + 1) + h * tl.load(row + FIELD + 2) + start * stride_l, 16)
    offs = tl.arange(0, BLOCK)[:, None] * tl.multiple_of(stride_l.to(tl.int32), 8) + tl.arange(0, HEAD_DIM)[None, :]
    return base + offs


@triton.jit
def _multi_chunk_attn_kernel(
    table,  # int64 [n_q * NQF + n_kv * NKF]: Q-chunk rows, then KV-chunk rows
    n_q,  # number of (non-empty) Q chunks
    n_kv,  # number of (non-empty) KV chunks
    scale,  # softmax scale (> 0)
    n_split,  # SPLIT: K/V ranges per query tile
    kv_tiles,  # SPLIT: BLOCK_N tiles over all KV chunks
    ws_out,  # SPLIT: fp32 [n_split, B, H, n_tiles * BLOCK_M, HEAD_DIM] partial outputs
    ws_lse,  # SPLIT: fp32 [n_split, B, H, n_tiles * BLOCK_M] their LSEs
    DTYPE: tl.constexpr,  # element type of Q, K, V and the output
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FINALIZE: tl.constexpr,
    UPCAST: tl.constexpr,  # compute tiles in fp32 (interpreter only)
    REP: tl.constexpr = 1,  # query heads per K/V head (grouped-query attention)
    SPLIT: tl.constexpr = False,  # one K/V range per program; partials to the workspace
):
    if SPLIT:  # program x = tile * n_split + split: tile's queries against one K/V range
        tile = tl.program_id(0) // n_split
        split = tl.program_id(0) % n_split
        lo = split * kv_tiles // n_split
        hi = (split + 1) * kv_tiles // n_split
    else:
        tile = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2).to(tl.int64)

    # -- which Q chunk owns this tile: the last i with cQO[i] <= tile (empty chunks are not
    #    in the table, so cQO is strictly increasing) --
    i = 0
    for j in range(1, n_q):
        i += (tl.load(table + j * NQF + F_TILE0) <= tile).to(tl.int32)
    row = table + i * NQF
    start_m = (tile - tl.load(row + F_TILE0)) * BLOCK_M
    len_q = tl.load(row + F_LQ)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    mask_m = offs_m < len_q

    # -- load the Q tile and the running (m, l) of its rows (a split starts empty: the combine
    #    merges the state). The running acc joins in the epilogue, rescaled by e^(m_old - m):
    #    the same value as loading it here and rescaling it at every KV tile, with fewer live
    #    registers. --
    q = tl.load(_tile(row, F_Q, DTYPE, b, h, start_m, BLOCK_M, HEAD_DIM), mask=mask_m[:, None], other=0.0)
    m_addr = _rows(row, F_M, b, h, offs_m)
    l_addr = _rows(row, F_L, b, h, offs_m)
    if SPLIT:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    else:
        m_old = tl.load(m_addr, mask=mask_m, other=float("-inf"))
        m_i = m_old
        l_i = tl.load(l_addr, mask=mask_m, other=0.0)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if UPCAST:
        q = q.to(tl.float32)

    # -- every KV chunk, every BLOCK_N tile of it (with SPLIT: the tiles in [lo, hi) of the
    #    concatenation): online softmax. m stays in natural-log units (as stored);
    #    exponentials are exp2 of one FMA per score. --
    qk_scale = scale * LOG2E
    kv_table = table + n_q * NQF
    if REP == 1:  # compile-time branch: the MHA kernel is unchanged
        h_kv = h
    else:  # grouped-query attention: query head h reads K/V head h // REP
        h_kv = h // REP
    for j in range(0, n_kv):
        kv_row = kv_table + j * NKF
        len_kv = tl.load(kv_row + F_LK)
        if SPLIT:  # this chunk's tiles t0 .. t0 + cdiv(len_kv, BLOCK_N) within [lo, hi)
            t0 = tl.load(kv_row + F_KTILE0)
            n_start = (tl.maximum(lo, t0) - t0) * BLOCK_N
            n_end = tl.minimum(hi - t0, tl.cdiv(len_kv, BLOCK_N)) * BLOCK_N
        else:
            n_start = 0
            n_end = len_kv
        for start_n in range(n_start, n_end, BLOCK_N):
            mask_n = start_n + tl.arange(0, BLOCK_N) < len_kv
            k = tl.load(_tile(kv_row, F_K, DTYPE, b, h_kv, start_n, BLOCK_N, HEAD_DIM), mask=mask_n[:, None], other=0.0)
            v = tl.load(_tile(kv_row, F_V, DTYPE, b, h_kv, start_n, BLOCK_N, HEAD_DIM), mask=mask_n[:, None], other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            qk = tl.dot(q, tl.trans(k))  # [BLOCK_M, BLOCK_N] unscaled scores
            qk = tl.where(mask_n[None, :], qk, float("-inf"))
            # every tile holds >= 1 valid key, so m_new is finite and no -inf - -inf arises
            m_new = tl.maximum(m_i, tl.max(qk, 1) * scale)
            alpha = tl.math.exp2((m_i - m_new) * LOG2E)
            p = tl.math.exp2(qk * qk_scale - (m_new * LOG2E)[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
            m_i = m_new

    if SPLIT:
        # -- this range's partial, normalised (output, LSE), into the workspace rows of the
        #    tile (padded rows included: their queries are 0); a range without keys: (0, -inf) --
        n_tiles = tl.num_programs(0) // n_split
        ws_row = ((split * tl.num_programs(1) + b) * tl.num_programs(2) + h) * (n_tiles * BLOCK_M)
        ws_row += tile * BLOCK_M + tl.arange(0, BLOCK_M)
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        tl.store(ws_lse + ws_row, tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(l_safe)))
        tl.store(ws_out + ws_row[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :], acc / l_safe[:, None])
    else:
        # -- merge the running acc, store the state (and the normalised output if finalizing) --
        acc_ptrs = _tile(row, F_ACC, tl.float32, b, h, start_m, BLOCK_M, HEAD_DIM)
        rescale = tl.where(m_old == float("-inf"), 0.0, tl.math.exp2((m_old - m_i) * LOG2E))  # no -inf - -inf
        acc += tl.load(acc_ptrs, mask=mask_m[:, None], other=0.0) * rescale[:, None]
        tl.store(acc_ptrs, acc, mask=mask_m[:, None])
        tl.store(m_addr, m_i, mask=mask_m)
        tl.store(l_addr, l_i, mask=mask_m)
        if FINALIZE:
            l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # rows that saw no keys output 0
            out = acc / l_safe[:, None]
            o_ptrs = _tile(row, F_O, DTYPE, b, h, start_m, BLOCK_M, HEAD_DIM)
            tl.store(o_ptrs, out.to(DTYPE), mask=mask_m[:, None])


# ---------------------------------------------------------------------------------------
# Launch configurations, chosen per launch from (head dim, SM version, grid size). No
# autotuning at import.
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class KernelConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# TABLES[(head_dim, table)] = (config for full grids, config for small grids). Not tuned on
# hardware (timed on an H100 only: docs/gpu-suite.md): chosen from the AOT compile so that no entry spills
# registers and shared memory fits every GPU the table serves (tests/test_kernel_choice.py
# compiles each entry for each of them):
#   80: sm_80, sm_87                      (A100; 163 KiB shared memory per block)
#   86: sm_86, sm_89, sm_120, sm_121      (A10, L4, L40S, RTX 30/40/50; 99 KiB per block)
#   90: sm_90, sm_100, sm_103, sm_110     (H100/H200, B200/B300; 227 KiB per block)
# Full grids take 128-row query tiles; the small-grid entry takes 64-row tiles, for launches
# whose 128-row grid would leave SMs without a program (``pick_config``). At D 128, 64-key
# tiles need 8 warps; with 128 query rows they reach 255 registers and spill on sm_80/86/89/
# 120 (8 to 72 bytes), so there full grids keep 32-key tiles and small grids take 64 x 64.
TABLES: dict[tuple[int, int], tuple[KernelConfig, KernelConfig]] = {
    (32, 80): (KernelConfig(128, 64, 4, 3), KernelConfig(64, 64, 4, 3)),
    (64, 80): (KernelConfig(128, 64, 4, 3), KernelConfig(64, 64, 4, 2)),
    (128, 80): (KernelConfig(128, 32, 8, 3), KernelConfig(64, 64, 8, 3)),
    (32, 86): (KernelConfig(128, 64, 4, 3), KernelConfig(64, 64, 4, 3)),
    (64, 86): (KernelConfig(128, 64, 8, 3), KernelConfig(64, 64, 4, 3)),
    (128, 86): (KernelConfig(128, 32, 8, 3), KernelConfig(64, 64, 8, 3)),
    (32, 90): (KernelConfig(128, 64, 4, 3), KernelConfig(64, 64, 8, 3)),
    (64, 90): (KernelConfig(128, 64, 4, 3), KernelConfig(64, 64, 4, 3)),
    (128, 90): (KernelConfig(128, 64, 8, 3), KernelConfig(64, 64, 8, 3)),
}
# The GPUs each table is checked on (SM versions).
TABLE_ARCHS: dict[int, tuple[int, ...]] = {80: (80,), 86: (86, 89, 120), 90: (90, 100)}
# Full-grid configuration per (head dim, arch major): 8 = sm_80, 9 = sm_90.
CONFIGS: dict[tuple[int, int], KernelConfig] = {
    (d, t // 10): cfgs[0] for (d, t), cfgs in TABLES.items() if t in (80, 90)
}
# Used when a GPU rejects the tabled configuration (shared memory, threads): at most 48 KiB of
# shared memory at D 128, no spills on sm_80/86/90.
SAFE_CONFIG = KernelConfig(64, 32, 4, 2)
_INTERPRETER_CONFIG = KernelConfig(32, 32, 1, 1)  # small tiles keep the interpreter quick


def table_for(sm: int) -> int:
    """The table serving SM version ``sm`` (80, 86, 89, 90, 100, 120, ...)."""
    major = sm // 10
    if sm in (86, 89) or major >= 12:  # 99 KiB of shared memory per block
        return 86
    return 90 if major >= 9 else 80


def q_tiles(q_lengths: Sequence[int], block_m: int) -> int:
    """Programs along the grid's first axis: query tiles of ``block_m`` rows over all chunks."""
    return sum(triton.cdiv(n, block_m) for n in q_lengths)


def kv_tile_count(kv_lengths: Sequence[int], block_n: int) -> int:
    """BLOCK_N tiles over all K/V chunks (each chunk's last tile may be partial)."""
    return sum(triton.cdiv(n, block_n) for n in kv_lengths)


def pick_config(
    head_dim: int, arch: int, q_lengths: Sequence[int] = (), batch_heads: int = 0, sms: int = 0
) -> KernelConfig:
    """Configuration for ``head_dim`` on SM version ``arch`` (80, 86, 90, ...; a single digit
    is a major version, 8 meaning sm_80). The full-grid entry, unless the launch (query chunk
    lengths ``q_lengths``, ``batch_heads`` = B * H) would give fewer programs than the GPU's
    ``sms`` streaming multiprocessors: then the small-grid entry (smaller query tiles, more
    programs). Older archs than any table take the oldest table."""
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"triton backend supports head dims {SUPPORTED_HEAD_DIMS}, got {head_dim}")
    sm = arch * 10 if arch < 20 else arch
    full, small = TABLES[(head_dim, table_for(sm))]
    if q_tiles(q_lengths, full.block_m) * batch_heads < sms:
        return small
    return full


def pick_launch(head_dim: int, arch: int, q_lengths: Sequence[int], kv_lengths: Sequence[int],
                batch_heads: int, sms: int) -> tuple[KernelConfig, int]:
    """(configuration, K/V splits) of a launch on a GPU of ``sms`` SMs. A full-grid launch
    (programs >= SMs) takes the full-grid entry unsplit. A smaller one takes the full-grid entry
    split along K/V where ``combine.split_count`` finds a split that fills the GPU better (each
    program one K/V range, the partials merged by one combine launch), else ``pick_config``'s
    small-grid entry."""
    sm = arch * 10 if arch < 20 else arch
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"triton backend supports head dims {SUPPORTED_HEAD_DIMS}, got {head_dim}")
    full = TABLES[(head_dim, table_for(sm))][0]
    programs = q_tiles(q_lengths, full.block_m) * batch_heads
    if programs >= sms:
        return full, 1
    splits = split_count(programs, kv_tile_count(kv_lengths, full.block_n), sms)
    if splits > 1:
        return full, splits
    return pick_config(head_dim, sm, q_lengths, batch_heads, sms), 1


@functools.lru_cache(maxsize=None)
def _device_info(index: int | None) -> tuple[int, int]:
    """(SM version, number of SMs) of CUDA device ``index`` (None: the current device)."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device() if index is None else index)
    return props.major * 10 + props.minor, props.multi_processor_count


_rejected: set[tuple[int | None, KernelConfig]] = set()  # (device index, config) a GPU refused


def _strides(t: torch.Tensor) -> list[int]:
    """B, H, L strides in elements; 0 for dims of size 1 (their stride is arbitrary)."""
    return [st if n > 1 else 0 for n, st in zip(t.shape[:3], t.stride()[:3])]


def _kernel_ready(t: torch.Tensor) -> bool:
    """What ``_tile`` assumes: unit stride along D, 16-byte aligned start, B/H/L strides that
    are multiples of 8 elements, and 128-row tiles addressable with int32 offsets."""
    strides = _strides(t)
    return (
        t.stride(-1) == 1
        and t.data_ptr() % 16 == 0
        and all(st % 8 == 0 for st in strides)
        and strides[2] < 2**31 // 128
    )


def _as_kernel_input(t: torch.Tensor) -> torch.Tensor:
    return t if _kernel_ready(t) else t.clone(memory_format=torch.contiguous_format)


def _check_in_place(t: torch.Tensor, what: str) -> None:
    if not _kernel_ready(t):
        raise ValueError(
            f"triton backend writes {what} in place and needs it 16-byte aligned, unit stride along "
            f"D and B/H/L strides that are multiples of 8 (got strides {tuple(t.stride())})"
        )


def launch_choice(device: torch.device, head_dim: int, q_lengths: Sequence[int], kv_lengths: Sequence[int],
                  batch_heads: int) -> tuple[KernelConfig, int]:
    """``pick_launch`` for the CUDA device's SM version and SM count; ``SAFE_CONFIG`` unsplit
    where this device refused that configuration before."""
    sm, sms = _device_info(device.index)
    cfg, splits = pick_launch(head_dim, sm, q_lengths, kv_lengths, batch_heads, sms)
    return (SAFE_CONFIG, 1) if (device.index, cfg) in _rejected else (cfg, splits)


def _launch_config(device: torch.device, head_dim: int, q_lengths: Sequence[int], batch_heads: int,
                   kv_lengths: Sequence[int] | None = None) -> KernelConfig:
    """The configuration ``launch_choice`` picks (with ``kv_lengths``; without them,
    ``pick_config``'s, as before split launches existed)."""
    if kv_lengths is not None:
        return launch_choice(device, head_dim, q_lengths, kv_lengths, batch_heads)[0]
    sm, sms = _device_info(device.index)
    cfg = pick_config(head_dim, sm, q_lengths, batch_heads, sms)
    return SAFE_CONFIG if (device.index, cfg) in _rejected else cfg


@dataclass
class _Launch:
    """A launch ready to queue: the device table, grid sizes, and for a split launch its
    workspace (fp32 partials) and the combine that merges them into the states."""

    table: torch.Tensor
    n_tiles: int
    kv_tiles: int
    cfg: KernelConfig
    n_split: int
    ws_out: torch.Tensor | None = None
    ws_lse: torch.Tensor | None = None
    combine: CombinePlan | None = None


@dataclass
class _Plan:
    """One launch of the kernel: the chunk table (host rows), its sizes and constants, and the
    tensors whose addresses it holds; ``work``: the (state, output or None) of each Q chunk
    in the table."""

    rows: list[int]
    n_q: int
    n_kv: int
    scale: float
    dtype: torch.dtype
    D: int
    B: int
    H: int
    cfg: KernelConfig
    n_split: int
    finalizing: bool
    interp: bool
    device: torch.device
    rep: int
    keep: list[torch.Tensor]
    work: list[tuple[AttnState, torch.Tensor | None]]

    def prepare(self, cfg: KernelConfig, n_split: int) -> _Launch:
        """The chunk table on the device for ``cfg``'s tiles and, when split, the workspace and
        the combine plan (all allocated and uploaded here, once)."""
        n_tiles, kv_tiles = _set_first_tiles(self.rows, self.n_q, self.n_kv, cfg.block_m, cfg.block_n)
        ready = _Launch(device_table(self.rows, self.device), n_tiles, kv_tiles, cfg, n_split)
        if n_split > 1:
            rows = n_tiles * cfg.block_m  # workspace rows: every tile's, padding included
            ready.ws_out = torch.empty(n_split, self.B, self.H, rows, self.D, dtype=torch.float32, device=self.device)
            ready.ws_lse = torch.empty(n_split, self.B, self.H, rows, dtype=torch.float32, device=self.device)
            parts, lses = [], []
            for i, (state, _) in enumerate(self.work):  # Q chunk i's rows of the workspace (views)
                first = self.rows[i * NQF.value + F_TILE0.value] * cfg.block_m
                end = first + state.acc.shape[2]
                parts.append(ready.ws_out[:, :, :, first:end])  # [S, B, H, Lq_i, D]
                lses.append(ready.ws_lse[:, :, :, first:end])  # [S, B, H, Lq_i]
            outs = [o for _, o in self.work] if self.finalizing else None
            ready.combine = CombinePlan([s for s, _ in self.work], parts, lses, outs, None)
        return ready

    def launch(self, ready: _Launch) -> None:
        cfg, split = ready.cfg, ready.n_split > 1
        _multi_chunk_attn_kernel[(ready.n_tiles * ready.n_split, self.B, self.H)](
            ready.table, self.n_q, self.n_kv, self.scale, ready.n_split, ready.kv_tiles,
            ready.ws_out if split else ready.table, ready.ws_lse if split else ready.table,
            DTYPE=TL_DTYPES[self.dtype], HEAD_DIM=self.D, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            FINALIZE=self.finalizing, UPCAST=self.interp, REP=self.rep, SPLIT=split,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
        if split:
            ready.combine.launch()


def _plan(
    q_chunks: Sequence[torch.Tensor],
    kv_chunks: Sequence[tuple[torch.Tensor, torch.Tensor]],
    states: Sequence[AttnState],
    scale: float,
    out: Sequence[torch.Tensor] | None,
    cfg: KernelConfig | None,
    n_split: int | None,
) -> _Plan | None:
    """Check the inputs and build the launch; None when there is nothing to launch (no query
    rows, or no keys: then the outputs, if asked for, are written from the states here)."""
    dtype = q_chunks[0].dtype
    B, H, _, D = q_chunks[0].shape
    device = q_chunks[0].device
    interp = interpreting()
    if dtype not in (torch.float16, torch.bfloat16) and not (interp and dtype == torch.float32):
        raise TypeError(f"triton backend needs fp16/bf16 inputs (fp32 only when interpreting), got {dtype}")
    if D not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"triton backend supports head dims {SUPPORTED_HEAD_DIMS}, got {D}")
    if not scale > 0:
        raise ValueError(f"triton backend needs a positive softmax scale, got {scale}")
    if n_split is not None and n_split < 1:
        raise ValueError(f"triton backend: n_split must be at least 1, got {n_split}")

    rows: list[int] = []  # Q-chunk rows, then KV-chunk rows (see NQF / NKF)
    keep: list[torch.Tensor] = []  # tensors whose addresses are in the table stay alive
    work: list[tuple[AttnState, torch.Tensor | None]] = []
    for i, (q, s) in enumerate(zip(q_chunks, states)):
        Lq = q.shape[2]
        if Lq == 0:
            continue
        q = _as_kernel_input(q)
        _check_in_place(s.acc, "AttnState.acc")
        o = q
        if out is not None:
            o = out[i]
            if o.dtype != dtype:
                raise TypeError(f"triton backend writes outputs in the query dtype {dtype}, got {o.dtype}")
            _check_in_place(o, "the output")
        keep += [q, o, s.acc, s.m, s.l]
        work.append((s, None if out is None else o))
        rows += [q.data_ptr(), *_strides(q), s.acc.data_ptr(), *_strides(s.acc)]
        rows += [s.m.data_ptr(), *_strides(s.m), s.l.data_ptr(), *_strides(s.l)]
        rows += [o.data_ptr(), *_strides(o), Lq, -1]  # first tile: filled in by _set_first_tiles
    kv_lengths = []
    for k, v in kv_chunks:
        if k.shape[2] == 0:
            continue
        k, v = _as_kernel_input(k), _as_kernel_input(v)
        keep += [k, v]
        rows += [k.data_ptr(), *_strides(k), v.data_ptr(), *_strides(v), k.shape[2], -1]
        kv_lengths.append(k.shape[2])
    if not work or B * H == 0:
        return None
    heads_kv = {k.shape[1] for k, _ in kv_chunks}
    if len(heads_kv) > 1 or any(H % x for x in heads_kv):
        raise ValueError(f"triton backend needs one K/V head count dividing H={H}, got {sorted(heads_kv)}")
    rep = H // heads_kv.pop() if heads_kv else 1  # REP = H / H_kv, a kernel constant
    if not kv_lengths:  # nothing to attend to: the states stay as they are
        for s, o in zip(states, out or []):
            finalize(s, dtype, o)
        return None
    q_lengths = [s.acc.shape[2] for s, _ in work]
    if cfg is None and interp:
        cfg = _INTERPRETER_CONFIG
    if cfg is None:
        cfg, auto_split = launch_choice(device, D, q_lengths, kv_lengths, B * H)
        n_split = n_split or auto_split
    return _Plan(rows, len(work), len(kv_lengths), scale, dtype, D, B, H, cfg, n_split or 1, out is not None,
                 interp, device, rep, keep, work)


def attend_triton(
    q_chunks: Sequence[torch.Tensor],
    kv_chunks: Sequence[tuple[torch.Tensor, torch.Tensor]],
    states: Sequence[AttnState],
    scale: float,
    out: Sequence[torch.Tensor] | None = None,
    cfg: KernelConfig | None = None,
    n_split: int | None = None,
) -> None:
    """Update ``states`` (and write ``out`` when given) in ONE kernel launch, or, for a launch
    split along K/V, one launch and its combine.

    q_chunks[i]: [B, H, Lq_i, D]; kv_chunks[j]: (K_j, V_j) [B, H_kv, Lk_j, D] (H_kv dividing
    H; query head h reads K/V head h // (H / H_kv), no copy); all one dtype
    (fp16/bf16 on GPU; fp32 too under the interpreter); D in {32, 64, 128}. Inputs that are
    not kernel-ready (see ``_kernel_ready``) are copied; ``states[i].acc`` and ``out[i]``
    ([B, H, Lq_i, D], query dtype, receives acc / l) are written in place, so they must be
    kernel-ready or a ValueError is raised. ``cfg`` overrides the launch configuration and
    ``n_split`` the number of K/V ranges per query tile (default: ``pick_launch`` for the
    device and grid; small tiles, unsplit, under the interpreter).
    """
    plan = _plan(q_chunks, kv_chunks, states, scale, out, cfg, n_split)
    if plan is None:
        return
    try:
        plan.launch(plan.prepare(plan.cfg, plan.n_split))
    except OutOfResources:  # raised before anything runs
        if plan.interp or plan.cfg == SAFE_CONFIG:
            raise
        _rejected.add((plan.device.index, plan.cfg))
        plan.launch(plan.prepare(SAFE_CONFIG, 1))
    del plan  # freed memory is reused only by work queued after this launch on the stream


def prepare_triton(
    q_chunks: Sequence[torch.Tensor],
    kv_chunks: Sequence[tuple[torch.Tensor, torch.Tensor]],
    states: Sequence[AttnState],
    scale: float,
    out: Sequence[torch.Tensor] | None = None,
    cfg: KernelConfig | None = None,
    n_split: int | None = None,
) -> Callable[[], None]:
    """``attend_triton``'s launch prepared once: its inputs checked, its chunk table built and
    uploaded, a split launch's workspace and combine table too; each call of the result queues
    the kernel launch (and a split launch's combine) alone, with no host allocation or copy, so
    it is cheap to issue and capturable in a CUDA graph (each call merges into ``states``
    again). ``cfg`` and ``n_split``: as ``attend_triton`` (by default the configuration this
    device accepts). A configuration the GPU refuses at the first call (``OutOfResources``,
    before anything is written) is replaced by ``SAFE_CONFIG`` unsplit, for later launches
    of the device too (that one call prepares again)."""
    plan = _plan(q_chunks, kv_chunks, states, scale, out, cfg, n_split)
    if plan is None:
        raise ValueError("prepare_triton: nothing to launch (no query rows or no keys)")
    ready = [plan.prepare(plan.cfg, plan.n_split)]

    def run() -> None:
        try:
            plan.launch(ready[0])
        except OutOfResources:  # raised before the state is touched: SAFE_CONFIG from now on
            if plan.interp or ready[0].cfg == SAFE_CONFIG:
                raise
            _rejected.add((plan.device.index, ready[0].cfg))
            ready[0] = plan.prepare(SAFE_CONFIG, 1)
            plan.launch(ready[0])

    return run


def _set_first_tiles(rows: list[int], n_q: int, n_kv: int, block_m: int, block_n: int) -> tuple[int, int]:
    """Write each Q chunk's first query tile and each KV chunk's first K/V tile (exclusive
    prefix sums of tile counts) into their table rows; returns the totals."""
    n_tiles = 0
    for i in range(n_q):
        rows[i * NQF.value + F_TILE0.value] = n_tiles
        n_tiles += triton.cdiv(rows[i * NQF.value + F_LQ.value], block_m)
    kv_tiles, base = 0, n_q * NQF.value
    for j in range(n_kv):
        rows[base + j * NKF.value + F_KTILE0.value] = kv_tiles
        kv_tiles += triton.cdiv(rows[base + j * NKF.value + F_LK.value], block_n)
    return n_tiles, kv_tiles


# ---------------------------------------------------------------------------------------
# Ahead-of-time compilation (no GPU needed): used by tests and BENCHMARKS.md.
# ---------------------------------------------------------------------------------------
def aot_compile(head_dim: int, dtype: torch.dtype, arch: int, finalize: bool = True, cfg: KernelConfig | None = None,
                rep: int = 1, split: bool = False):
    """Compile the kernel for ``sm_<arch>`` without a GPU (``compile_for``). ``rep``: query
    heads per K/V head; ``split``: the split-K/V variant (``finalize`` does not apply to it)."""
    cfg = cfg or pick_config(head_dim, arch)
    constexprs = {
        "DTYPE": TL_DTYPES[dtype], "HEAD_DIM": head_dim, "BLOCK_M": cfg.block_m,
        "BLOCK_N": cfg.block_n, "FINALIZE": finalize and not split, "UPCAST": False, "REP": rep,
        "SPLIT": split,
    }  # fmt: skip
    signature = {"table": "*i64", "n_q": "i32", "n_kv": "i32", "scale": "fp32", "n_split": "i32",
                 "kv_tiles": "i32", "ws_out": "*fp32", "ws_lse": "*fp32"}
    return compile_for(_multi_chunk_attn_kernel, signature, constexprs, arch, cfg.num_warps, cfg.num_stages)


def resource_usage(compiled) -> dict[str, int]:
    """Shared memory (bytes), registers per thread and stack bytes (spills) of an AOT-compiled
    kernel, read from its cubin with the ``cuobjdump`` bundled with triton."""
    import re
    import subprocess
    import tempfile

    import triton.backends.nvidia as nvidia_backend

    tool = os.path.join(os.path.dirname(nvidia_backend.__file__), "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        report = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    regs, stack = re.search(r"REG:(\d+) STACK:(\d+)", report).groups()
    return {"shared": compiled.metadata.shared, "registers": int(regs), "stack": int(stack)}
