"""CPU backend: torch's fused CPU flash attention (returns an LSE) plus an in-place merge.

Per call, the KV chunks are concatenated into one contiguous K/V (a copy of O(Lk * D), cheap
next to the O(Lq * Lk * D) attention) so that every Q chunk needs one attention call and one
merge, whatever the number of KV chunks; this also rounds the low-precision partial output
only once per call. The op takes any strides, so Q chunks are passed as they are.

``_scaled_dot_product_flash_attention_for_cpu`` (torch 2.13) crashes the process (SIGFPE) on
Lq = 0 or Lk = 0: empty chunks never reach it.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from .state import AttnState, merge_partial_

_sdpa_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def attend_cpu(
    q_chunks: Sequence[torch.Tensor],
    kv_chunks: Sequence[tuple[torch.Tensor, torch.Tensor]],
    states: Sequence[AttnState],
    scale: float,
) -> None:
    """Update ``states[i]`` with attention of ``q_chunks[i]`` [B, H, Lq_i, D] against all
    ``kv_chunks`` (K_j, V_j each [B, H, Lk_j, D]). Inputs must share one dtype."""
    kv_chunks = [(k, v) for k, v in kv_chunks if k.shape[2] > 0]
    if not kv_chunks:
        return
    if len(kv_chunks) == 1:
        k, v = kv_chunks[0]
    else:
        k = torch.cat([k for k, _ in kv_chunks], dim=2)  # [B, H, sum Lk_j, D]
        v = torch.cat([v for _, v in kv_chunks], dim=2)  # [B, H, sum Lk_j, D]
    for q, state in zip(q_chunks, states):
        if q.numel() == 0:
            continue
        out, lse = _sdpa_cpu(q, k, v, dropout_p=0.0, is_causal=False, scale=scale)
        merge_partial_(state, out, lse)
