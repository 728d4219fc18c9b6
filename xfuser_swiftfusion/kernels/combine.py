"""Fused combine: partial attention results merged into running states in ONE launch.

The SDPA backends (cuDNN, torch's CUDA ops, flash-attn) return a normalised partial output and
its log-sum-exp per query row; the split-K/V path of the triton kernel writes one such partial
per K/V range. A partial ``(out, lse)`` is the state acc = out, m = lse, l = 1 (state.py), so
merging S partials of one Q chunk into its running state is, per row, with r = the new m where
finite and 0 where it is -inf (no -inf - -inf):

    m' = max(m, lse_1, ..., lse_S)
    acc' = acc e^(m - r) + sum_s out_s e^(lse_s - r)      l' = l e^(m - r) + sum_s e^(lse_s - r)

applied one partial at a time (the same arithmetic as ``state.merge_partial_``). With torch ops
that is about a dozen kernels per Q chunk and partial; ``combine`` does every Q chunk of a call,
every partial and, when asked, the finalize (``out = acc / l`` in the output dtype, rows with
l == 0 output 0) in one launch. Partials of dead batch entries (``dead[b]``: every key of the
call masked) contribute nothing, whatever the op returned for them (``state.merge_masked_``).

Layouts: ``parts[i]`` ``[S, B, H, Lq_i, D]`` (or ``[B, H, Lq_i, D]``: S = 1) in any float
dtype, ``lses[i]`` ``[S, B, H, Lq_i]`` (or ``[B, H, Lq_i]``) fp32, any strides with unit
stride along D (flash-attn's and cuDNN's outputs are ``[B, L, H, D]`` buffers, cuDNN's LSE a
``[B, H, L, 1]`` one). The kernel reads them in place through a chunk table of addresses and
element strides, as the attention kernel does (``triton_attend``):

* grid = (sum_i ceil(Lq_i / BLOCK_M), B, H); program (x, b, h) owns BLOCK_M rows of one chunk;
* a row of the table per Q chunk: the partial out (element offset from the kernel's ``part``
  argument, B/H/L/split strides), the partial LSE (the same from ``lse``), the state's acc, m
  and l and the output (address, B/H/L strides each), Lq and the chunk's first tile. The
  partials' base addresses are launch arguments, so a plan built once serves every later
  (out, lse) of the same layout: an SDPA op allocates its outputs anew at each call.

On CPU tensors without the Triton interpreter the same merge runs as torch ops (``state.py``),
which is also the reference the tests compare the kernel with.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import triton
import triton.language as tl

from .interpret import interpreting
from .state import AttnState, finalize, merge_masked_, merge_partial_

# Table row of one Q chunk (int64): partial out and LSE (element offset from the ``part`` /
# ``lse`` argument, stride_b, stride_h, stride_l, stride_split), acc, m, l and the output
# (address, stride_b, stride_h, stride_l), then Lq and the chunk's first tile. Strides in
# elements.
C_PART, C_LSE, C_ACC, C_M, C_L, C_O = (tl.constexpr(x) for x in (0, 5, 10, 14, 18, 22))
C_LQ, C_TILE0, NCF = tl.constexpr(26), tl.constexpr(27), tl.constexpr(28)
TILE_ELEMENTS = 2048  # BLOCK_M * BLOCK_D of a program (16 rows at D 128) ...
TILE_ELEMENTS_UNALIGNED = 512  # ... and without vector loads: a pointer per element held
NUM_WARPS = 4
TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@triton.jit
def row_ptrs(row, FIELD: tl.constexpr, b, h, offs):
    """fp32 pointers to rows ``offs`` of [b, h] of the [B, H, L] tensor at ``row[FIELD:]``."""
    base = tl.load(row + FIELD).to(tl.pointer_type(tl.float32))
    return base + b * tl.load(row + FIELD + 1) + h * tl.load(row + FIELD + 2) + offs * tl.load(row + FIELD + 3)


@triton.jit
def _tile_ptrs(row, FIELD: tl.constexpr, ELEM: tl.constexpr, b, h, offs_m, offs_d, ALIGNED: tl.constexpr):
    """Pointers [BLOCK_M, BLOCK_D] to rows ``offs_m`` of [b, h] of the [B, H, L, D] tensor at
    ``row[FIELD:]`` (unit stride along D). ``ALIGNED``: 16-byte aligned base and B/H/L strides
    that are multiples of 8 elements (the launcher checked), so that loads vectorise."""
    base = tl.load(row + FIELD).to(tl.pointer_type(ELEM))
    base = base + b * tl.load(row + FIELD + 1) + h * tl.load(row + FIELD + 2)
    stride_l = tl.load(row + FIELD + 3)
    if ALIGNED:
        base = tl.multiple_of(base, 16)
        stride_l = tl.multiple_of(stride_l, 8)
    return base + offs_m[:, None] * stride_l + offs_d[None, :]


@triton.jit
def _combine_kernel(
    table,  # int64 [n_q * NCF]
    part,  # PART*: the partial outputs (each chunk's at its offset)
    lse,  # fp32*: their LSEs (each chunk's at its offset)
    n_q,  # Q chunks in the table (each with >= 1 row)
    n_split,  # partials per Q chunk (0: finalize only)
    dead,  # uint8 [B]: 1 = the batch entry's partials are dropped (read when HAS_DEAD)
    PART: tl.constexpr,  # element type of the partial outputs
    OUT: tl.constexpr,  # element type of the outputs (written when FINALIZE)
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # the power of two >= HEAD_DIM
    BLOCK_M: tl.constexpr,
    HAS_DEAD: tl.constexpr,
    FINALIZE: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    tile = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2).to(tl.int64)
    i = 0  # the Q chunk owning this tile: the last one whose first tile is <= tile
    for j in range(1, n_q):
        i += (tl.load(table + j * NCF + C_TILE0) <= tile).to(tl.int32)
    row = table + i * NCF
    offs_m = (tile - tl.load(row + C_TILE0)) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < tl.load(row + C_LQ)
    mask = mask_m[:, None] & (offs_d < HEAD_DIM)[None, :]

    m_ptrs = row_ptrs(row, C_M, b, h, offs_m)
    l_ptrs = row_ptrs(row, C_L, b, h, offs_m)
    acc_ptrs = _tile_ptrs(row, C_ACC, tl.float32, b, h, offs_m, offs_d, ALIGNED)
    m = tl.load(m_ptrs, mask=mask_m, other=float("-inf"))
    l = tl.load(l_ptrs, mask=mask_m, other=0.0)
    acc = tl.load(acc_ptrs, mask=mask, other=0.0)

    part_base = part + tl.load(row + C_PART) + b * tl.load(row + C_PART + 1) + h * tl.load(row + C_PART + 2)
    part_stride = tl.load(row + C_PART + 3)
    if ALIGNED:
        part_base = tl.multiple_of(part_base, 16)
        part_stride = tl.multiple_of(part_stride, 8)
    part_ptrs = part_base + offs_m[:, None] * part_stride + offs_d[None, :]
    lse_ptrs = lse + tl.load(row + C_LSE) + b * tl.load(row + C_LSE + 1) + h * tl.load(row + C_LSE + 2)
    lse_ptrs += offs_m * tl.load(row + C_LSE + 3)
    split_part = tl.load(row + C_PART + 4)
    split_lse = tl.load(row + C_LSE + 4)
    if HAS_DEAD:
        drop = tl.load(dead + b) != 0
    for s in range(0, n_split):
        x = tl.load(lse_ptrs + s * split_lse, mask=mask_m, other=float("-inf"))
        p = tl.load(part_ptrs + s * split_part, mask=mask, other=0.0).to(tl.float32)
        if HAS_DEAD:
            x = tl.where(drop, float("-inf"), x)
            p = tl.where(drop, 0.0, p)
        m_new = tl.maximum(m, x, propagate_nan=tl.PropagateNan.ALL)
        ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no -inf - -inf
        f_state = tl.exp(m - ref)
        f_part = tl.exp(x - ref)
        acc = acc * f_state[:, None] + p * f_part[:, None]
        l = l * f_state + f_part
        m = m_new

    tl.store(acc_ptrs, acc, mask=mask)
    tl.store(m_ptrs, m, mask=mask_m)
    tl.store(l_ptrs, l, mask=mask_m)
    if FINALIZE:
        l_safe = tl.where(l == 0.0, 1.0, l)  # rows that saw no keys output 0
        o_ptrs = _tile_ptrs(row, C_O, OUT, b, h, offs_m, offs_d, ALIGNED)
        tl.store(o_ptrs, (acc / l_safe[:, None]).to(OUT), mask=mask)


def block_m(head_dim: int, aligned: bool = True) -> int:
    """Rows per program: a [rows, D] tile of ``TILE_ELEMENTS`` (``TILE_ELEMENTS_UNALIGNED``
    without vector loads) elements, at least 4 rows."""
    return max(4, (TILE_ELEMENTS if aligned else TILE_ELEMENTS_UNALIGNED) // block_d(head_dim))


def block_d(head_dim: int) -> int:
    """The power of two >= ``head_dim`` (Triton tiles are powers of two; the rest is masked)."""
    return 1 << max(0, head_dim - 1).bit_length()


def _strides(t: torch.Tensor, dims: int) -> list[int]:
    """Strides of the first ``dims`` dimensions in elements; 0 for dimensions of size 1."""
    return [st if n > 1 else 0 for n, st in zip(t.shape[:dims], t.stride()[:dims])]


def _aligned(t: torch.Tensor, dims: int) -> bool:
    """16-byte aligned start, unit stride along D and the other strides multiples of 8 elements."""
    return t.data_ptr() % 16 == 0 and all(st % 8 == 0 for st in _strides(t, dims))


def _offset(t: torch.Tensor, base: torch.Tensor) -> int:
    """Elements from ``base``'s first element to ``t``'s (same dtype)."""
    delta = t.data_ptr() - base.data_ptr()
    if delta % t.element_size():
        raise ValueError("combine: partials must be element-aligned with each other")
    return delta // t.element_size()


def _split_view(t: torch.Tensor, rank: int) -> torch.Tensor:
    """``t`` with a leading split dimension: ``[B, H, L(, D)]`` -> ``[1, B, H, L(, D)]`` (view)."""
    return t.unsqueeze(0) if t.dim() == rank else t


class CombinePlan:
    """One launch of the combine kernel, built once: its table on the device and its constants.
    ``launch()`` queues the kernel alone (no host allocation or copy), so a plan can be
    launched many times and inside CUDA graph capture (the merge then repeats on whatever the
    partial and state tensors hold)."""

    def __init__(self, states: Sequence[AttnState], parts: Sequence[torch.Tensor] | None,
                 lses: Sequence[torch.Tensor] | None, out: Sequence[torch.Tensor] | None,
                 dead: torch.Tensor | None) -> None:
        from .graph_tables import device_table

        acc0 = states[0].acc
        B, H, _, D = acc0.shape
        self.device = acc0.device
        self.grid_bh = (B, H)
        self.n_split = 0 if parts is None else _split_view(parts[0], 4).shape[0]
        self.part_dtype = torch.float32 if parts is None else parts[0].dtype
        self.out_dtype = torch.float32 if out is None else out[0].dtype
        self.head_dim = D
        chunks = []  # (partial out [S, B, H, Lq, D], LSE [S, B, H, Lq], state, output) per Q chunk with rows
        for i, s in enumerate(states):
            if s.acc.shape[2] == 0:
                continue
            if parts is None:  # finalize only: no partial is read
                part, lse = s.acc.unsqueeze(0), s.m.unsqueeze(0)
            else:
                part, lse = _split_view(parts[i], 4), _split_view(lses[i], 3)
                if part.shape[0] != self.n_split or lse.shape[0] != self.n_split:
                    raise ValueError("combine: every Q chunk needs the same number of partials")
                if part.stride(-1) != 1 or part.dtype != self.part_dtype or lse.dtype != torch.float32:
                    raise ValueError("combine: partial outputs need unit stride along D and one dtype, "
                                     "LSEs fp32")
            o = s.acc if out is None else out[i]
            if out is not None and (o.stride(-1) != 1 or o.dtype != self.out_dtype):
                raise ValueError("combine: outputs need unit stride along D and one dtype")
            if s.acc.stride(-1) != 1:
                raise ValueError("combine: AttnState.acc needs unit stride along D")
            chunks.append((part, lse, s, o))
        aligned = all(_aligned(p, 4) and _aligned(s.acc, 3) and _aligned(o, 3) for p, _, s, o in chunks)
        self.block_m = block_m(D, aligned)
        # the partials of the first chunk are the bases the others are addressed from
        self.part, self.lse = (chunks[0][0], chunks[0][1]) if chunks else (None, None)
        rows: list[int] = []
        n_tiles = 0
        for part, lse, s, o in chunks:
            # partial out and LSE: strides of (split, b, h, l) -> table order b, h, l, split
            ps, ls = _strides(part, 4), _strides(lse, 4)
            rows += [_offset(part, self.part), ps[1], ps[2], ps[3], ps[0]]
            rows += [_offset(lse, self.lse), ls[1], ls[2], ls[3], ls[0]]
            for t in (s.acc, s.m, s.l, o):
                rows += [t.data_ptr(), *_strides(t, 3)]
            rows += [s.acc.shape[2], n_tiles]
            n_tiles += -(-s.acc.shape[2] // self.block_m)
        keep = [t for part, lse, s, o in chunks for t in (part, lse, s.acc, s.m, s.l, o)]
        self.n_q, self.n_tiles = len(rows) // NCF.value, n_tiles
        self.aligned, self.finalizing = aligned, out is not None
        self.dead = None if dead is None else dead.contiguous().view(torch.uint8)  # [B] bool as bytes
        self.keep = keep
        self.table = device_table(rows, self.device) if rows else None

    def launch(self, part: torch.Tensor | None = None, lse: torch.Tensor | None = None) -> None:
        """Queue the kernel. ``part`` / ``lse``: partials laid out as those the plan was built
        with (same shapes, strides and dtype; the first chunk's rows first), at new addresses;
        default: the partials it was built with."""
        if self.n_tiles == 0 or 0 in self.grid_bh:
            return
        part = self.part if part is None else part
        lse = self.lse if lse is None else lse
        _combine_kernel[(self.n_tiles, *self.grid_bh)](
            self.table, part, lse, self.n_q, self.n_split, self.table if self.dead is None else self.dead,
            PART=TL_DTYPES[self.part_dtype], OUT=TL_DTYPES[self.out_dtype], HEAD_DIM=self.head_dim,
            BLOCK_D=block_d(self.head_dim), BLOCK_M=self.block_m, HAS_DEAD=self.dead is not None,
            FINALIZE=self.finalizing, ALIGNED=self.aligned, num_warps=NUM_WARPS,
        )  # fmt: skip


# Split-K/V (flash-decoding): a launch whose programs (query tiles x B x H) leave SMs idle runs
# each query tile as ``splits`` programs over disjoint K/V ranges, their partials merged by one
# combine launch. ``split_count`` picks the count from a cost model: a wave of programs takes
# (K/V tiles per program + SPLIT_OVERHEAD_TILES) tile-times, the overhead standing for a
# program's fixed work (its Q tile, its epilogue, its share of the combine).
MAX_SPLITS = 16
SPLIT_MIN_TILES = 4  # K/V tiles per range at least
SPLIT_OVERHEAD_TILES = 2


def split_count(programs: int, kv_tiles: int, slots: int, allowed: Callable[[int], bool] = lambda s: True) -> int:
    """K/V ranges per query tile for a launch of ``programs`` programs over ``kv_tiles`` K/V
    tiles each, on a GPU that runs ``slots`` programs at once (its SMs): the count among 1 and
    the ``allowed`` ones up to ``MAX_SPLITS`` (at least ``SPLIT_MIN_TILES`` tiles per range)
    with the least waves x (tiles per range + ``SPLIT_OVERHEAD_TILES``); 1 when the launch
    fills the GPU or on a tie."""
    if programs <= 0 or slots <= 0 or programs >= slots:
        return 1
    best, best_cost = 1, -(-programs // slots) * (kv_tiles + SPLIT_OVERHEAD_TILES)
    for s in range(2, min(MAX_SPLITS, kv_tiles // SPLIT_MIN_TILES) + 1):
        cost = -(-programs * s // slots) * (-(-kv_tiles // s) + SPLIT_OVERHEAD_TILES)
        if cost < best_cost and allowed(s):
            best, best_cost = s, cost
    return best


def uses_kernel(device: torch.device) -> bool:
    """Whether ``combine`` runs the Triton kernel for tensors on ``device`` (CUDA, or CPU under
    ``TRITON_INTERPRET=1``) rather than torch ops (CPU)."""
    return device.type == "cuda" or interpreting()


def combine(states: Sequence[AttnState], parts: Sequence[torch.Tensor] | None,
            lses: Sequence[torch.Tensor] | None, out: Sequence[torch.Tensor] | None = None,
            dead: torch.Tensor | None = None) -> None:
    """``states[i]`` ⊕= every partial ``(parts[i][s], lses[i][s])``; then, with ``out``,
    ``out[i]`` = acc / l in its dtype (rows with l == 0: 0). ``parts`` None: finalize only.
    ``dead``: [B] bool, batch entries whose partials are dropped. One kernel launch on CUDA
    (module docstring); torch ops on CPU tensors unless interpreting."""
    if not states:
        return
    if uses_kernel(states[0].acc.device):
        CombinePlan(states, parts, lses, out, dead).launch()
        return
    for i, s in enumerate(states):
        if parts is not None:
            part, lse = _split_view(parts[i], 4), _split_view(lses[i], 3)
            for p, x in zip(part, lse):
                if dead is None:
                    merge_partial_(s, p, x)
                else:
                    merge_masked_(s, p, x, dead)
        if out is not None:
            finalize(s, out[i].dtype, out[i])


def prepare_combine(states: Sequence[AttnState], parts: Sequence[torch.Tensor] | None,
                    lses: Sequence[torch.Tensor] | None, out: Sequence[torch.Tensor] | None = None,
                    dead: torch.Tensor | None = None) -> Callable[[], None]:
    """``combine``'s launch prepared once (table built and uploaded): each call of the result
    is the kernel launch alone. CUDA tensors (or CPU ones under the interpreter)."""
    return CombinePlan(states, parts, lses, out, dead).launch


def compile_for(fn, signature: dict[str, str], constexprs: dict, arch: int, num_warps: int, num_stages: int):
    """Compile the jitted ``fn`` for ``sm_<arch>`` without a GPU; returns triton's
    CompiledKernel (``.asm["cubin"]``, ``.asm["ptx"]``, ``.metadata.shared`` in bytes)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def aot_compile(head_dim: int, part_dtype: torch.dtype, out_dtype: torch.dtype, arch: int,
                finalize: bool = True, has_dead: bool = False, aligned: bool = True):
    """Compile the combine kernel for ``sm_<arch>`` without a GPU (``compile_for``)."""
    constexprs = {
        "PART": TL_DTYPES[part_dtype], "OUT": TL_DTYPES[out_dtype], "HEAD_DIM": head_dim,
        "BLOCK_D": block_d(head_dim), "BLOCK_M": block_m(head_dim, aligned), "HAS_DEAD": has_dead,
        "FINALIZE": finalize, "ALIGNED": aligned,
    }  # fmt: skip
    signature = {"table": "*i64", "part": "*" + {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}[part_dtype],
                 "lse": "*fp32", "n_q": "i32", "n_split": "i32", "dead": "*u8"}
    return compile_for(_combine_kernel, signature, constexprs, arch, NUM_WARPS, 1)
