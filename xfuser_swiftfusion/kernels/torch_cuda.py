"""torch and cudnn backends (CUDA): torch's own fused attention ops that return a
log-sum-exp. torch covers the shapes the Triton kernel and flash-attn do not (head dims such as
72, 88, 96, 256; fp32); cudnn is cuDNN's fused attention, the FlashAttention-3-class kernel on
Hopper (what xFuser's USP runs there).

Per call, the KV chunks are concatenated into one K/V [B, H, sum Lk_j, D], the non-empty Q
chunks into one Q [B, H, sum Lq_i, D], and ONE op call computes all of it; one launch of the
fused combine (``combine.py``) then merges each chunk's rows of its (out, lse) into the chunk's
state and, when outputs are asked for, finalizes them: a backend call is its op call, the
joins, and one combine launch, whatever the number of chunks (merging with torch ops took about
a dozen small kernels per Q chunk; a Flux layer's thousands of them filled the GPU's launch
queue and held the host back). K/V with fewer heads than Q (grouped-query attention) are
repeated to the query heads after joining. The torch backend's op is chosen per call:

* ``_scaled_dot_product_flash_attention`` (FlashAttention-2 inside torch) for fp16/bf16,
  D <= 256 and a multiple of 8, on sm_80 or newer, when torch was built with it;
* ``_scaled_dot_product_efficient_attention`` (memory-efficient attention) otherwise: any
  head dim, fp32 included. Its LSE is [B, H, ceil(Lq / 32) * 32] on CUDA (padded) and
  [B, H, Lq] on ROCm, so only the first Lq entries are read. Calls with a key mask always
  use it, with the mask as an additive ``attn_bias`` [B, H, Lq, Lk] (an expanded view of
  ``[B, 1, 1, ceil(Lk / 16) * 16]`` storage, 16-element aligned as torch's SDPA front end
  pads it); batch entries whose keys are all masked merge as LSE -inf (``merge_masked_``).

The cudnn backend's op is ``_scaled_dot_product_cudnn_attention(q, k, v, attn_bias=None,
compute_log_sumexp=True, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale)``
(the same signature and meta kernel in torch 2.11 and 2.13); its LSE is fp32 ``[B, H, Lq, 1]``
(natural log, scale included; xFuser's CUDNN backend squeezes the last dim too) and it is read
as the ``[B, H, Lq]`` view ``lse[..., 0]``. What it takes (torch's ``can_use_cudnn_attention``
checks, ``cudnn_supports``): fp16/bf16 only; sm_80 to sm_121; D a multiple of 8 and at most
128 (256 only on sm_90/sm_100 with cuDNN newer than 9.22; torch 2.11 and 2.13 ship 9.19 and
9.20); B and H at most 65535; no K/V of length 1 (a call whose joined K/V has one key runs
on the torch op instead, logged once). Key-masked calls never come here (the dispatcher
runs them on the torch backend).

cuDNN has no split along the keys, so a call whose query tiles leave SMs idle (3 heads x 2336
queries: 55 tiles of 128 rows on 132 SMs) splits the joined K/V into ``S`` equal ranges itself
(flash-decoding through the batch dimension): Q repeated S times ``[S * B, H, Lq, D]`` against
the ranges ``[S * B, H, Lk / S, D]`` (a view of the joined K/V when B = 1) in one op call, the S
partials merged by the same combine launch. ``combine.split_count`` picks S among the divisors
of Lk (1: no split).

All ops take [B, H, L, D] with unit stride along D and return the output as [B, H, Lq, D]
and the LSE as fp32 [B, H, >= Lq]. The op is a parameter of ``attend_torch``, so the same
merge runs on CPU tensors with the CPU op in the tests.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..log import get_logger, log_once
from .state import AttnState, joined_kv, key_bias, repeat_kv

logger = get_logger("xfuser_swiftfusion.kernels")

# (q, k, v [B, H, L, D], scale) -> (out [B, H, Lq, D], lse fp32 [B, H, >= Lq])
AttnOp = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]

FLASH_MAX_HEAD_DIM = 256
BIAS_ALIGN = 16  # elements: memory-efficient attention's attn_bias alignment


def efficient_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's memory-efficient attention with ``compute_log_sumexp=True``; LSE padded along L."""
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, None, True, dropout_p=0.0, is_causal=False, scale=scale
    )[:2]
    return out, lse


def masked_efficient_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                        bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``efficient_op`` with an additive key bias ``[B, 1, 1, Lk]`` (see ``key_bias``)."""
    B, H, Lq, _ = q.shape
    attn_bias = bias.expand(B, H, Lq, k.shape[2])  # [B, 1, 1, Lk] -> [B, H, Lq, Lk] (view)
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, attn_bias, True, dropout_p=0.0, is_causal=False, scale=scale
    )[:2]
    return out, lse


def flash_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's FlashAttention-2 (fp16/bf16, D <= 256 and a multiple of 8, sm_80+)."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, dropout_p=0.0, is_causal=False, return_debug_mask=False, scale=scale
    )[:2]
    return out, lse


def flash_op_supports(head_dim: int, dtype: torch.dtype, capability: tuple[int, int], built: bool) -> bool:
    """Whether ``flash_op`` runs (head_dim, dtype) on a GPU of ``capability``; ``built``:
    torch was built with FlashAttention (``torch.backends.cuda.is_flash_attention_available``)."""
    return (
        built
        and dtype in (torch.float16, torch.bfloat16)
        and head_dim % 8 == 0
        and 0 < head_dim <= FLASH_MAX_HEAD_DIM
        and capability >= (8, 0)
    )


CUDNN_MAX_HEAD_DIM = 128  # 256 needs cuDNN > 9.22 on sm_90/sm_100 (torch 2.11/2.13 ship 9.19/9.20)
CUDNN_MAX_BATCH_HEADS = 65535
_cudnn_sdpa = torch.ops.aten._scaled_dot_product_cudnn_attention


def cudnn_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cuDNN's fused attention with ``compute_log_sumexp=True``: out [B, H, Lq, D], LSE fp32
    ``[B, H, Lq, 1]`` returned as its ``[B, H, Lq]`` view."""
    out, lse = _cudnn_sdpa(q, k, v, None, True, dropout_p=0.0, is_causal=False,
                           return_debug_mask=False, scale=scale)[:2]
    return out, lse[..., 0]


def cudnn_supports(head_dim: int, dtype: torch.dtype, capability: tuple[int, int], built: bool) -> str | None:
    """Why cuDNN attention cannot run inputs of (head_dim, dtype) on a GPU of ``capability``,
    or None; ``built``: torch has cuDNN (``torch.backends.cudnn.is_available()``)."""
    if not built:
        return "torch built with cuDNN (torch.backends.cudnn.is_available())"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"fp16/bf16 inputs (got {dtype})"
    if head_dim % 8 or not 0 < head_dim <= CUDNN_MAX_HEAD_DIM:
        return f"a head dim <= {CUDNN_MAX_HEAD_DIM} and a multiple of 8 (got {head_dim})"
    if not (8, 0) <= capability <= (12, 1):
        return f"sm_80 to sm_121 (got sm_{capability[0]}{capability[1]})"
    return None


def cuda_op(q: torch.Tensor) -> AttnOp:
    """The op for CUDA queries ``q`` [B, H, L, D]: ``flash_op`` where it runs, else ``efficient_op``."""
    capability = torch.cuda.get_device_capability(q.device)
    built = torch.backends.cuda.is_flash_attention_available()
    return flash_op if flash_op_supports(q.shape[-1], q.dtype, capability, built) else efficient_op


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself if its last dim has unit stride (what both ops need), else a contiguous copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _joined(chunks: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[B, H, L_j, D]`` chunks -> ``[B, H, sum L_j, D]`` with unit stride along D (no copy
    for one chunk that already has it)."""
    return _unit_last(chunks[0]) if len(chunks) == 1 else torch.cat(list(chunks), dim=2)


CUDNN_TILE_ROWS = 128  # query rows (and keys) per cuDNN program on sm_80/sm_90
_split_views_refused = False  # cuDNN rejected strided K/V range views once: copy them since


def cudnn_kv_splits(batch_heads: int, q_len: int, kv_len: int, sms: int) -> int:
    """K/V ranges for a cuDNN call of ``batch_heads`` (B * H) x ``q_len`` queries against
    ``kv_len`` keys on ``sms`` SMs (``combine.split_count`` over the divisors of ``kv_len``)."""
    from .combine import split_count

    tile = CUDNN_TILE_ROWS
    programs = batch_heads * -(-q_len // tile)
    return split_count(programs, -(-kv_len // tile), sms, lambda s: kv_len % s == 0 and kv_len // s >= 2)


def _split_call(op: AttnOp, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``op`` over ``splits`` equal K/V ranges at once (module docstring): out
    ``[splits, B, H, Lq, D]``, LSE ``[splits, B, H, >= Lq]``."""
    global _split_views_refused
    B, H, Lq, D = q.shape
    qs = q.unsqueeze(0).expand(splits, B, H, Lq, D).reshape(splits * B, H, Lq, D)  # copies Q

    def ranges(x: torch.Tensor) -> torch.Tensor:  # [B, H, Lk, D] -> [S * B, H, Lk / S, D]
        x = x.unflatten(2, (splits, -1)).movedim(2, 0)  # [S, B, H, Lk / S, D] (view)
        x = x.reshape(splits * B, H, x.shape[3], D)  # a view when B == 1
        return x.contiguous() if _split_views_refused else x

    try:
        o, lse = op(qs, ranges(k), ranges(v), scale)
    except RuntimeError as exc:
        if _split_views_refused:
            raise
        _split_views_refused = True
        log_once(logger, "kernel-cudnn-split-views", f"kernel cudnn: the K/V ranges of a split "
                 f"call as strided views were refused ({exc}); they are copied from now on")
        o, lse = op(qs, ranges(k), ranges(v), scale)
    return o.unflatten(0, (splits, B)), lse.unflatten(0, (splits, B))


def _resolve_op(op: AttnOp | None, q: torch.Tensor, kv_len: int) -> AttnOp:
    """``op``, ``cuda_op(q)`` by default; cuDNN's calls with one key run on ``cuda_op(q)``."""
    op = op or cuda_op(q)
    if op is cudnn_op and kv_len < 2:  # cuDNN takes no K/V of length 1
        log_once(logger, "kernel-cudnn-one-key", "kernel cudnn: cuDNN attention takes no K/V of "
                 "length 1; such calls run on the torch backend's op")
        op = cuda_op(q)
    return op


def _splits(kv_splits: int | None, op: AttnOp, q: torch.Tensor, kv_len: int) -> int:
    """``kv_splits`` checked, or by default ``cudnn_kv_splits`` for ``cudnn_op`` on CUDA (1
    otherwise); q: the joined queries [B, H, Lq, D]."""
    B, H, Lq, _ = q.shape
    if kv_splits is None:
        kv_splits = 1
        if op is cudnn_op and q.device.type == "cuda":
            from .triton_attend import _device_info

            kv_splits = cudnn_kv_splits(B * H, Lq, kv_len, _device_info(q.device.index)[1])
    if kv_splits < 1 or kv_len % kv_splits:
        raise ValueError(f"attend_torch: kv_splits must divide the joined K/V length {kv_len}, got {kv_splits}")
    if op is cudnn_op and max(B * kv_splits, H) > CUDNN_MAX_BATCH_HEADS:
        raise ValueError(f"kernel cudnn: cuDNN attention takes at most {CUDNN_MAX_BATCH_HEADS} "
                         f"batch entries and heads, got B={B * kv_splits}, H={H}")
    return kv_splits


def _call(op: AttnOp, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
          splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The op call: out ``[S, B, H, Lq, D]``, LSE ``[S, B, H, Lq]`` (S = ``splits`` K/V ranges)."""
    B, H, Lq, _ = q.shape
    if splits == 1:
        o, lse = op(q, k, v, scale)  # [B, H, Lq, D], [B, H, >= Lq]
        o, lse = o.unsqueeze(0), lse.unsqueeze(0)
    else:
        o, lse = _split_call(op, q, k, v, scale, splits)  # [S, B, H, Lq, D], [S, B, H, >= Lq]
    if lse.shape[1:3] != (B, H) or lse.shape[3] < Lq:
        raise RuntimeError(f"attention op returned lse of shape {tuple(lse.shape[1:])}, expected "
                           f"[B, H, >= Lq] for [B, H, Lq] = {(B, H, Lq)}")
    return o, lse[..., :Lq]


def attend_torch(
    q_chunks: Sequence[torch.Tensor],
    kv_chunks: Sequence[tuple[torch.Tensor, torch.Tensor]],
    states: Sequence[AttnState],
    scale: float,
    op: AttnOp | None = None,
    key_masks: Sequence[torch.Tensor | None] | None = None,
    out: Sequence[torch.Tensor] | None = None,
    kv_splits: int | None = None,
) -> None:
    """Update ``states[i]`` with attention of ``q_chunks[i]`` [B, H, Lq_i, D] against all
    ``kv_chunks`` (K_j, V_j each [B, H_kv, Lk_j, D], H_kv dividing H): one ``op`` call on the
    joined Q chunks and the joined K/V, one combine launch into the states (module docstring).
    Inputs share one dtype; ``op`` defaults to ``cuda_op(q)``. ``key_masks[j]``: [B, Lk_j]
    bool (True = attend) or None; with any mask the op is ``masked_efficient_op`` (``op`` must
    then be None). ``out[i]`` ([B, H, Lq_i, D], unit stride along D): written with acc / l
    (rows without keys: 0) by the same launch. ``kv_splits``: K/V ranges per op call (a
    divisor of the joined K/V length; default: ``cudnn_kv_splits`` for ``cudnn_op`` on CUDA,
    else 1)."""
    from .combine import combine

    joined = joined_kv(q_chunks, kv_chunks, states, key_masks, _joined)
    if joined is None:  # no keys or no rows: only the outputs, if asked for
        if out is not None:
            combine(states, None, None, out)
        return
    work, k, v, mask = joined  # k, v [B, H, sum Lk_j, D]; mask [B, sum Lk_j] or None
    outs = None if out is None else [o for q, o in zip(q_chunks, out) if q.numel() > 0]  # as work
    dead = None
    if mask is not None:
        if op is not None:
            raise ValueError("attend_torch: a key mask runs on masked_efficient_op; pass op=None")
        bias = key_bias(mask, k.dtype, BIAS_ALIGN)  # [B, 1, 1, sum Lk_j]
        dead = ~mask.any(dim=1)  # [B]: every key masked

        def op(q, k, v, scale):
            return masked_efficient_op(q, k, v, scale, bias)
    op = _resolve_op(op, work[0][0], k.shape[2])
    q = _joined([q for q, _ in work])  # [B, H, sum Lq_i, D]
    o, lse = _call(op, q, k, v, scale, _splits(kv_splits, op, q, k.shape[2]))
    # [S, B, H, sum Lq_i, (D)] -> chunk i's rows [S, B, H, Lq_i, (D)] (views)
    lengths = [c.shape[2] for c, _ in work]
    combine([s for _, s in work], o.split(lengths, dim=3), lse.split(lengths, dim=3), outs, dead)


def prepare_torch(q_chunks: Sequence[torch.Tensor], kv_chunks: Sequence[tuple[torch.Tensor, torch.Tensor]],
                  states: Sequence[AttnState], scale: float, *, op: AttnOp | None = None,
                  out: Sequence[torch.Tensor] | None = None, kv_splits: int | None = None) -> Callable[[], None]:
    """``attend_torch`` (without key masks) prepared once for CUDA tensors: the joined Q and
    K/V buffers allocated, the op and its split chosen, the combine's table built and uploaded.
    Each call of the result copies the chunks into the joined buffers, makes the op call and
    launches the combine: no table upload, capturable in a CUDA graph, cheap to issue (the op
    allocates its outputs, from the graph's pool under capture). Each call merges into
    ``states`` again."""
    from .combine import CombinePlan

    if not all(q.numel() for q in q_chunks) or not kv_chunks or not all(k.shape[2] for k, _ in kv_chunks):
        raise ValueError("prepare_torch: every Q and K/V chunk needs rows (leave empty ones out)")
    H = q_chunks[0].shape[1]

    def joiner(chunks: list[torch.Tensor]) -> tuple[torch.Tensor, Callable[[], object]]:
        """The joined [B, H, sum L, D] tensor and what refreshes it from the chunks."""
        if len(chunks) == 1 and chunks[0].stride(-1) == 1:
            return chunks[0], lambda: None
        buf = torch.cat(chunks, dim=2)
        return buf, lambda: torch.cat(chunks, dim=2, out=buf)

    q, join_q = joiner(list(q_chunks))  # [B, H, sum Lq_i, D]
    k, join_k = joiner([k for k, _ in kv_chunks])  # [B, H_kv, sum Lk_j, D]
    v, join_v = joiner([v for _, v in kv_chunks])
    op = _resolve_op(op, q, k.shape[2])
    splits = _splits(kv_splits, op, q, k.shape[2])
    o, lse = _call(op, q, repeat_kv(k, H), repeat_kv(v, H), scale, splits)  # fixes the layout
    lengths = [c.shape[2] for c in q_chunks]
    plan = CombinePlan(states, o.split(lengths, dim=3), lse.split(lengths, dim=3), out, None)

    def run() -> None:
        join_q(), join_k(), join_v()
        o, lse = _call(op, q, repeat_kv(k, H), repeat_kv(v, H), scale, splits)
        plan.launch(o, lse)

    return run
