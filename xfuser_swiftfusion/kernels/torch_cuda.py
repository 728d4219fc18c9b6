"""torch backend (CUDA): torch's own fused attention ops that return a log-sum-exp, for the
shapes the Triton kernel and flash-attn do not cover (head dims such as 72, 88, 96, 256; fp32).

Per call, the KV chunks are concatenated into one K/V [B, H, sum Lk_j, D] and every Q chunk
makes one op call against it; its (out, lse) is merged into the chunk's state exactly like
the CPU backend does (``merge_partial_``). K/V with fewer heads than Q (grouped-query
attention) are repeated to the query heads after joining. The op is chosen per call:

* ``_scaled_dot_product_flash_attention`` (FlashAttention-2 inside torch) for fp16/bf16,
  D <= 256 and a multiple of 8, on sm_80 or newer, when torch was built with it;
* ``_scaled_dot_product_efficient_attention`` (memory-efficient attention) otherwise: any
  head dim, fp32 included. Its LSE is [B, H, ceil(Lq / 32) * 32] on CUDA (padded) and
  [B, H, Lq] on ROCm, so only the first Lq entries are read. Calls with a key mask always
  use it, with the mask as an additive ``attn_bias`` [B, H, Lq, Lk] (an expanded view of
  ``[B, 1, 1, ceil(Lk / 16) * 16]`` storage, 16-element aligned as torch's SDPA front end
  pads it); batch entries whose keys are all masked merge as LSE -inf (``merge_masked_``).

Both take [B, H, L, D] with unit stride along D and return the output as [B, H, Lq, D] and
the LSE (natural log, scale included) as fp32 [B, H, >= Lq]. The op is a parameter of
``attend_torch``, so the same merge runs on CPU tensors with the CPU op in the tests.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .state import AttnState, joined_kv, key_bias, merge_masked_, merge_partial_

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
