"""CPU backend: torch's fused CPU flash attention (returns an LSE) plus an in-place merge.

Per call, the KV chunks are concatenated into one contiguous K/V, and consecutive Q chunks
into groups of at least ``BIG_TILE_ROWS`` rows (copies of O(L * D), cheap next to the
O(Lq * Lk * D) attention): one attention op per group, then one merge per Q chunk. This
matters for speed: the op tiles queries by 256 rows only when Lq >= 768 (64 below), so
512-row chunks run at ~57 GFLOP/s and their concatenation at ~78 on one Zen 4 core
(measured by scripts/bench_kernels.py). Joining no more than that keeps the transient copy and
output of a many-chunk call to about one group's size.

``_scaled_dot_product_flash_attention_for_cpu`` (torch 2.13) crashes the process (SIGFPE) on
Lq = 0 or Lk = 0: empty chunks never reach it. Its output for a query row holding a NaN is
NaN or 0 depending on Lk and the CPU (AVX2 / AVX-512): we make it NaN, as softmax math does.

Grouped-query attention (K/V with fewer heads than Q): K/V heads are repeated
(``repeat_interleave``) to the query heads after joining. Key masks: the op takes an additive
float mask in the query dtype (not a boolean one), ``[B, 1, 1, Lk]`` broadcast; for a batch
entry whose keys are all masked it returns output 0 and LSE 0, which ``merge_masked_``
replaces by LSE -inf.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from .state import AttnState, joined_kv, key_bias, merge_masked_, merge_partial_

_sdpa_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
BIG_TILE_ROWS = 768  # from this query length on the op tiles queries by 256 rows (64 below)


def _joined(chunks: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[B, H, L_j, D]`` chunks -> ``[B, H, sum L_j, D]`` (no copy for one chunk)."""
    return chunks[0] if len(chunks) == 1 else torch.cat(list(chunks), dim=2)


def attend_cpu(
    q_chunks: Sequence[torch.Tensor],
    kv_chunks: Sequence[tuple[torch.Tensor, torch.Tensor]],
    states: Sequence[AttnState],
    scale: float,
    key_masks: Sequence[torch.Tensor | None] | None = None,
) -> None:
    """Update ``states[i]`` with attention of ``q_chunks[i]`` [B, H, Lq_i, D] against all
    ``kv_chunks`` (K_j, V_j each [B, H_kv, Lk_j, D], H_kv dividing H; query head i uses K/V
    head i // (H / H_kv)). ``key_masks[j]``: [B, Lk_j] bool (True = attend) or None. Inputs
    must share one dtype."""
    joined = joined_kv(q_chunks, kv_chunks, states, key_masks, _joined)
    if joined is None:
        return
    work, k, v, mask = joined  # k, v [B, H, sum Lk_j, D]; mask [B, sum Lk_j] or None
    bias = None if mask is None else key_bias(mask, k.dtype)  # [B, 1, 1, sum Lk_j]
    dead = None if mask is None else ~mask.any(dim=1)  # [B]: every key masked
    for group in _groups(work):
        q = _joined([q for q, _ in group])  # [B, H, sum Lq_i, D]
        out, lse = _sdpa_cpu(q, k, v, dropout_p=0.0, is_causal=False, attn_mask=bias, scale=scale)[:2]
        # a query row holding a NaN: the op returns NaN or (out 0, LSE 0) depending on Lk and
        # the CPU's vector width; softmax math gives NaN, and so do we (it then poisons the merge)
        lse = lse.masked_fill(q.isnan().any(dim=-1), float("nan"))
        lengths = [c.shape[2] for c, _ in group]
        # [B, H, sum Lq_i, D] -> chunk i's rows [B, H, Lq_i, D] (views)
        for (_, state), o, l in zip(group, out.split(lengths, dim=2), lse.split(lengths, dim=2)):
            if dead is None:
                merge_partial_(state, o, l)
            else:
                merge_masked_(state, o, l, dead)


def _groups(work: list) -> list[list]:
    """Consecutive (Q chunk, state) pairs; a group is closed once it has ``BIG_TILE_ROWS`` rows
    and so have the chunks left (no short group at the end)."""
    groups, rows, left = [[]], 0, sum(q.shape[2] for q, _ in work)
    for item in work:
        if rows >= BIG_TILE_ROWS and left >= BIG_TILE_ROWS:
            groups.append([])
            rows = 0
        groups[-1].append(item)
        rows, left = rows + item[0].shape[2], left - item[0].shape[2]
    return groups
