"""torch and cudnn backends (CUDA): torch's own fused attention ops that return a
log-sum-exp. torch covers the shapes the Triton kernel and flash-attn do not (head dims such as
72, 88, 96, 256; fp32); cudnn is cuDNN's fused attention, the FlashAttention-3-class kernel on
Hopper (what xFuser's USP runs there).

Per call, the KV chunks are concatenated into one K/V [B, H, sum Lk_j, D] and every Q chunk
makes one op call against it; its (out, lse) is merged into the chunk's state exactly like
the CPU backend does (``merge_partial_``). K/V with fewer heads than Q (grouped-query
attention) are repeated to the query heads after joining. The torch backend's op is chosen
per call:

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

All ops take [B, H, L, D] with unit stride along D and return the output as [B, H, Lq, D]
and the LSE as fp32 [B, H, >= Lq]. The op is a parameter of ``attend_torch``, so the same
merge runs on CPU tensors with the CPU op in the tests.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..log import get_logger, log_once
from .state import AttnState, joined_kv, key_bias, merge_masked_, merge_partial_

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


def attend_torch(
    q_chunks: Sequence[torch.Tensor],
    kv_chunks: Sequence[tuple[torch.Tensor, torch.Tensor]],
    states: Sequence[AttnState],
    scale: float,
    op: AttnOp | None = None,
    key_masks: Sequence[torch.Tensor | None] | None = None,
) -> None:
    """Update ``states[i]`` with attention of ``q_chunks[i]`` [B, H, Lq_i, D] against all
    ``kv_chunks`` (K_j, V_j each [B, H_kv, Lk_j, D], H_kv dividing H): one ``op`` call per
    non-empty Q chunk on the concatenated K/V. Inputs share one dtype; ``op`` defaults to
    ``cuda_op(q)``. ``key_masks[j]``: [B, Lk_j] bool (True = attend) or None; with any mask
    the op is ``masked_efficient_op`` (``op`` must then be None)."""
    joined = joined_kv(q_chunks, kv_chunks, states, key_masks, _joined)
    if joined is None:
        return
    work, k, v, mask = joined  # k, v [B, H, sum Lk_j, D]; mask [B, sum Lk_j] or None
    dead = None
    if mask is not None:
        if op is not None:
            raise ValueError("attend_torch: a key mask runs on masked_efficient_op; pass op=None")
        bias = key_bias(mask, k.dtype, BIAS_ALIGN)  # [B, 1, 1, sum Lk_j]
        dead = ~mask.any(dim=1)  # [B]: every key masked

        def op(q, k, v, scale):
            return masked_efficient_op(q, k, v, scale, bias)
    op = op or cuda_op(work[0][0])
    if op is cudnn_op and k.shape[2] < 2:  # cuDNN takes no K/V of length 1
        log_once(logger, "kernel-cudnn-one-key", "kernel cudnn: cuDNN attention takes no K/V of "
                 "length 1; such calls run on the torch backend's op")
        op = cuda_op(work[0][0])
    if op is cudnn_op and (k.shape[0] > CUDNN_MAX_BATCH_HEADS or k.shape[1] > CUDNN_MAX_BATCH_HEADS):
        raise ValueError(f"kernel cudnn: cuDNN attention takes at most {CUDNN_MAX_BATCH_HEADS} "
                         f"batch entries and heads, got B={k.shape[0]}, H={k.shape[1]}")
    for q, state in work:
        out, lse = op(_unit_last(q), k, v, scale)  # [B, H, Lq, D], [B, H, >= Lq]
        Lq = q.shape[2]
        if lse.shape[:2] != state.m.shape[:2] or lse.shape[2] < Lq:
            raise RuntimeError(
                f"attention op returned lse of shape {tuple(lse.shape)}, expected [B, H, >= Lq] "
                f"for [B, H, Lq] = {tuple(state.m.shape)}"
            )
        if dead is None:
            merge_partial_(state, out, lse[..., :Lq])
        else:
            merge_masked_(state, out, lse[..., :Lq], dead)
