"""CPU backend: torch's fused CPU flash attention (returns an LSE) plus an in-place merge.

Per call, the KV chunks are concatenated into one contiguous K/V and the Q chunks into one
contiguous Q (copies of O(L * D), cheap next to the O(Lq * Lk * D) attention), so a call is
ONE attention op followed by one merge per Q chunk, whatever the numbers of chunks. Besides
the per-op overhead this matters for speed: the op tiles queries by 256 rows only when
Lq >= 768 (64 below), so 512-row chunks run at ~57 GFLOP/s and their concatenation at ~78
on one Zen 4 core (BENCHMARKS.md, "Kernels (CPU)"). It also rounds the low-precision
partial output only once per call.

``_scaled_dot_product_flash_attention_for_cpu`` (torch 2.13) crashes the process (SIGFPE) on
Lq = 0 or Lk = 0: empty chunks never reach it.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from .state import AttnState, merge_partial_

_sdpa_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _joined(chunks: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[B, H, L_j, D]`` chunks -> ``[B, H, sum L_j, D]`` (no copy for one chunk)."""
    return chunks[0] if len(chunks) == 1 else torch.cat(list(chunks), dim=2)


def attend_cpu(
    q_chunks: Sequence[torch.Tensor],
    kv_chunks: Sequence[tuple[torch.Tensor, torch.Tensor]],
    states: Sequence[AttnState],
    scale: float,
) -> None:
    """Update ``states[i]`` with attention of ``q_chunks[i]`` [B, H, Lq_i, D] against all
    ``kv_chunks`` (K_j, V_j each [B, H, Lk_j, D]). Inputs must share one dtype."""
    kv_chunks = [(k, v) for k, v in kv_chunks if k.shape[2] > 0]
    work = [(q, s) for q, s in zip(q_chunks, states) if q.numel() > 0]
    if not kv_chunks or not work:
        return
    k = _joined([k for k, _ in kv_chunks])  # [B, H, sum Lk_j, D]
    v = _joined([v for _, v in kv_chunks])  # [B, H, sum Lk_j, D]
    q = _joined([q for q, _ in work])       # [B, H, sum Lq_i, D]
    out, lse = _sdpa_cpu(q, k, v, dropout_p=0.0, is_causal=False, scale=scale)[:2]
    lengths = [c.shape[2] for c, _ in work]
    # [B, H, sum Lq_i, D] -> chunk i's rows [B, H, Lq_i, D] (views)
    for (_, state), o, l in zip(work, out.split(lengths, dim=2), lse.split(lengths, dim=2)):
        merge_partial_(state, o, l)
