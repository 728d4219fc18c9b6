"""flash-attn backend (CUDA): one ``flash_attn_func`` call per (Q chunk, KV chunk) pair, each
partial (out, lse) merged into the Q chunk's state. ``flash_attn`` is imported lazily, so
this module imports without it.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from .state import AttnState, merge_partial_


def _flash_attn_func():
    from flash_attn import flash_attn_func

    return flash_attn_func


def attend_flash(
    q_chunks: Sequence[torch.Tensor],
    kv_chunks: Sequence[tuple[torch.Tensor, torch.Tensor]],
    states: Sequence[AttnState],
    scale: float,
) -> None:
    """Update ``states[i]`` with attention of ``q_chunks[i]`` [B, H, Lq_i, D] against every
    (K_j, V_j) [B, H, Lk_j, D]; fp16/bf16 CUDA tensors."""
    flash_attn_func = _flash_attn_func()
    kv_chunks = [(k, v) for k, v in kv_chunks if k.shape[2] > 0]
    for q, state in zip(q_chunks, states):
        if q.numel() == 0:
            continue
        q_bl = q.transpose(1, 2)  # [B, H, Lq, D] -> [B, Lq, H, D]
        for k, v in kv_chunks:
            out, lse, _ = flash_attn_func(
                q_bl,
                k.transpose(1, 2),  # [B, H, Lk, D] -> [B, Lk, H, D]
                v.transpose(1, 2),  # [B, H, Lk, D] -> [B, Lk, H, D]
                softmax_scale=scale,
                return_attn_probs=True,
            )
            if lse.shape != state.m.shape:
                raise RuntimeError(
                    f"flash_attn_func returned lse of shape {tuple(lse.shape)}, expected "
                    f"[B, H, Lq] = {tuple(state.m.shape)}; unsupported flash-attn version"
                )
            merge_partial_(state, out.transpose(1, 2), lse)  # out [B, Lq, H, D] -> [B, H, Lq, D]
