"""flash-attn backend (CUDA): per call, the KV chunks are concatenated once into flash-attn's
layout [B, sum Lk_j, H, D], the non-empty Q chunks into [B, sum Lq_i, H, D], and ONE
``flash_attn_func`` call computes all of it (flash-attn splits the keys itself where its grid
would leave SMs idle); one launch of the fused combine (``combine.py``) merges each chunk's
rows of its (out, lse) into the chunk's state and, when outputs are asked for, finalizes them.
``flash_attn`` is imported lazily, so this module imports without it.

flash-attn 2 runs fp16/bf16 with D <= 256 and a multiple of 8 on sm_80 or newer (the
dispatcher checks this before choosing the backend). Grouped-query attention runs natively:
``flash_attn_func`` takes K/V with H_kv heads dividing the query heads H, query head i using
K/V head i // (H / H_kv), the convention of ``kernels.attend``. Key-masked calls never come
here (the dispatcher runs them on a backend with a key mask).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from .state import AttnState, nonempty

MAX_HEAD_DIM = 256


def supports(head_dim: int, dtype: torch.dtype, capability: tuple[int, int]) -> str | None:
    """Why flash-attn 2 cannot run (head_dim, dtype) on a GPU of ``capability``; None if it can."""
    if dtype not in (torch.float16, torch.bfloat16):
        return f"fp16/bf16 inputs (got {dtype})"
    if head_dim % 8 or not 0 < head_dim <= MAX_HEAD_DIM:
        return f"a head dim <= {MAX_HEAD_DIM} and a multiple of 8 (got {head_dim})"
    if capability < (8, 0):
        return f"sm_80 or newer (got sm_{capability[0]}{capability[1]})"
    return None


def _flash_attn_func():
    from flash_attn import flash_attn_func

    return flash_attn_func


def _blhd(chunks: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[B, H, L_j, D]`` chunks -> ``[B, sum L_j, H, D]`` (a view for one chunk, else one
    contiguous copy)."""
    if len(chunks) == 1:
        return chunks[0].transpose(1, 2)
    return torch.cat([c.transpose(1, 2) for c in chunks], dim=1)


def attend_flash(
    q_chunks: Sequence[torch.Tensor],
    kv_chunks: Sequence[tuple[torch.Tensor, torch.Tensor]],
    states: Sequence[AttnState],
    scale: float,
    out: Sequence[torch.Tensor] | None = None,
) -> None:
    """Update ``states[i]`` with attention of ``q_chunks[i]`` [B, H, Lq_i, D] against every
    (K_j, V_j) [B, H_kv, Lk_j, D] (H_kv dividing H): one flash-attn call on the joined Q chunks
    and the joined K/V, one combine launch; fp16/bf16 CUDA tensors. ``out[i]`` ([B, H, Lq_i, D],
    unit stride along D): written with acc / l (rows without keys: 0) by the same launch."""
    from .combine import combine

    kv_chunks, work = nonempty(q_chunks, kv_chunks, states)
    if not kv_chunks or not work:  # no keys or no rows: only the outputs, if asked for
        if out is not None:
            combine(states, None, None, out)
        return
    outs = None if out is None else [o for q, o in zip(q_chunks, out) if q.numel() > 0]  # as work
    flash_attn_func = _flash_attn_func()
    k = _blhd([k for k, _ in kv_chunks])  # [B, sum Lk_j, H_kv, D]
    v = _blhd([v for _, v in kv_chunks])  # [B, sum Lk_j, H_kv, D]
    q = _blhd([q for q, _ in work])  # [B, sum Lq_i, H, D]
    o, lse, _ = flash_attn_func(q if q.stride(-1) == 1 else q.contiguous(), k, v, softmax_scale=scale,
                                return_attn_probs=True)
    B, Lq, H, _ = q.shape
    if tuple(lse.shape) != (B, H, Lq):
        raise RuntimeError(f"flash_attn_func returned lse of shape {tuple(lse.shape)}, expected "
                           f"[B, H, Lq] = {(B, H, Lq)}; unsupported flash-attn version")
    # [B, sum Lq_i, H, D] -> chunk i's rows [B, H, Lq_i, D] (views)
    lengths = [c.shape[2] for c, _ in work]
    combine([s for _, s in work], o.transpose(1, 2).split(lengths, dim=2), lse.split(lengths, dim=2), outs)
