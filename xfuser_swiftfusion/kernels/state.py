"""Running softmax state of one Q chunk and its merge algebra (paper appendix, "Merging
Attention Outputs").

A state is the paper's A' = [O', l, m] for every query row:
``acc`` [B, H, L, D] is O' (the unnormalised output), ``l`` [B, H, L] the running sum and
``m`` [B, H, L] the stabiliser, so that

    output = acc / l        LSE = m + log(l)

A row that has seen no keys has acc = 0, l = 0, m = -inf. All tensors are fp32.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass
class AttnState:
    """Running state of ONE Q chunk, all fp32, on the device of the queries."""

    acc: torch.Tensor  # [B, H, L, D] unnormalised output accumulator
    m: torch.Tensor  # [B, H, L] stabiliser (running max / LSE reference), -inf initially
    l: torch.Tensor  # [B, H, L] running sum, 0 initially

    def lse(self) -> torch.Tensor:
        """Log-sum-exp of all scores seen so far, [B, H, L] fp32; -inf for rows with no keys."""
        return self.m + torch.log(self.l)


def new_state(q: torch.Tensor) -> AttnState:
    """Empty state for queries ``q`` [B, H, L, D]: acc = 0, m = -inf, l = 0 (fp32)."""
    B, H, L, D = q.shape
    return AttnState(
        acc=torch.zeros(B, H, L, D, dtype=torch.float32, device=q.device),
        m=torch.full((B, H, L), float("-inf"), dtype=torch.float32, device=q.device),
        l=torch.zeros(B, H, L, dtype=torch.float32, device=q.device),
    )


def _rescale_factors(m_a: torch.Tensor, m_b: torch.Tensor):
    """m = max(m_a, m_b) and the factors e^(m_a - m), e^(m_b - m).

    Where both sides are -inf (no keys on either side) the reference is taken as 0, so both
    factors are e^-inf = 0 instead of e^(-inf + inf) = NaN.
    """
    m = torch.maximum(m_a, m_b)
    ref = m.masked_fill(m == float("-inf"), 0.0)
    return m, torch.exp(m_a - ref), torch.exp(m_b - ref)


def merge_states(a: AttnState, b: AttnState) -> AttnState:
    """a ⊕ b: the exact merge of two states of the same queries over disjoint key sets.

    m = max(m_a, m_b); l = l_a e^(m_a-m) + l_b e^(m_b-m); acc = acc_a e^(m_a-m) + acc_b e^(m_b-m).
    Commutative bit for bit; associative up to rounding.
    """
    m, fa, fb = _rescale_factors(a.m, b.m)
    return AttnState(
        acc=a.acc * fa.unsqueeze(-1) + b.acc * fb.unsqueeze(-1),
        m=m,
        l=a.l * fa + b.l * fb,
    )


def merge_partial_(state: AttnState, out: torch.Tensor, lse: torch.Tensor) -> None:
    """state ⊕= (out, lse), in place.

    ``out`` [B, H, L, D] is a normalised partial attention output (any float dtype, any
    strides) and ``lse`` [B, H, L] its log-sum-exp: as a state it is acc = out, m = lse, l = 1.
    """
    m, f_state, f_part = _rescale_factors(state.m, lse.float())
    state.acc.mul_(f_state.unsqueeze(-1)).addcmul_(out, f_part.unsqueeze(-1))
    state.l.mul_(f_state).add_(f_part)
    state.m.copy_(m)


def finalize(state: AttnState, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """Normalised output acc / l cast to ``dtype`` [B, H, L, D], written into ``out`` if given.

    Rows that saw no keys (l == 0) output 0.
    """
    l = state.l.masked_fill(state.l == 0, 1.0)  # no-key rows: acc is 0, so the result is 0
    if out is None:
        out = torch.empty(state.acc.shape, dtype=dtype, device=state.acc.device)
    return torch.div(state.acc, l.unsqueeze(-1), out=out)  # one pass, cast on write


def nonempty(q_chunks: Sequence[torch.Tensor], kv_chunks: Sequence[tuple[torch.Tensor, torch.Tensor]],
             states: Sequence[AttnState]
             ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[tuple[torch.Tensor, AttnState]]]:
    """The K/V chunks with keys and the (Q chunk, state) pairs with rows: what a backend
    attends (either list empty: nothing to do; torch's CPU and CUDA ops fail on Lq or Lk 0)."""
    return ([(k, v) for k, v in kv_chunks if k.shape[2] > 0],
            [(q, s) for q, s in zip(q_chunks, states) if q.numel() > 0])


def repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """K or V ``[B, h_kv, L, D]`` -> ``[B, heads, L, D]``: query head i uses K/V head
    ``i // (heads / h_kv)`` (grouped-query attention); ``x`` itself when ``h_kv == heads``."""
    rep = heads // x.shape[1]
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)  # [B, h_kv, L, D] -> [B, heads, L, D]


def joined_key_mask(key_masks: Sequence[torch.Tensor | None] | None,
                    kv_chunks: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor | None:
    """The key masks of ``kv_chunks`` (``[B, Lk_j]`` bool, True = attend; None = every key)
    joined along the keys ``[B, sum Lk_j]``; None when no chunk has a mask."""
    if key_masks is None or all(m is None for m in key_masks):
        return None
    parts = [torch.ones(k.shape[0], k.shape[2], dtype=torch.bool, device=k.device) if m is None else m
             for (k, _), m in zip(kv_chunks, key_masks)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def joined_kv(q_chunks: Sequence[torch.Tensor], kv_chunks: Sequence[tuple[torch.Tensor, torch.Tensor]],
              states: Sequence[AttnState], key_masks: Sequence[torch.Tensor | None] | None,
              join: Callable[[Sequence[torch.Tensor]], torch.Tensor]
              ) -> tuple[list[tuple[torch.Tensor, AttnState]], torch.Tensor, torch.Tensor,
                         torch.Tensor | None] | None:
    """What a backend attends on concatenated K/V: the (Q chunk, state) pairs with rows, K and V
    of the chunks with keys joined by ``join`` and repeated to the query heads
    (``[B, H_kv, sum Lk_j, D] -> [B, H, sum Lk_j, D]``), and their key masks joined
    ``[B, sum Lk_j]`` (None: every key). None when there is nothing to attend."""
    if key_masks is not None:
        key_masks = [m for (k, _), m in zip(kv_chunks, key_masks) if k.shape[2] > 0]
    kv_chunks, work = nonempty(q_chunks, kv_chunks, states)
    if not kv_chunks or not work:
        return None
    H = work[0][0].shape[1]
    k = repeat_kv(join([k for k, _ in kv_chunks]), H)
    v = repeat_kv(join([v for _, v in kv_chunks]), H)
    return work, k, v, joined_key_mask(key_masks, kv_chunks)


def key_bias(mask: torch.Tensor, dtype: torch.dtype, align: int = 1) -> torch.Tensor:
    """Additive bias ``[B, 1, 1, Lk]`` in ``dtype`` of a key mask ``[B, Lk]`` (0 where True,
    -inf where False). With ``align`` > 1 the storage is ``[B, 1, 1, ceil(Lk / align) * align]``
    and the result its first Lk columns (as torch's SDPA front end pads memory-efficient biases)."""
    B, Lk = mask.shape
    padded = -(-Lk // align) * align
    bias = torch.zeros(B, 1, 1, padded, dtype=dtype, device=mask.device)
    bias[..., :Lk].masked_fill_(~mask[:, None, None, :], float("-inf"))
    return bias[..., :Lk]


def merge_masked_(state: AttnState, out: torch.Tensor, lse: torch.Tensor, dead: torch.Tensor) -> None:
    """``merge_partial_`` of a key-masked partial result: batch entries ``dead`` ([B] bool,
    every key of the call masked) contribute nothing (LSE -inf, output 0), whatever the op
    returned for them (ops return LSE 0 or NaN rows there)."""
    lse = lse.masked_fill(dead[:, None, None], float("-inf"))  # no host sync
    out = out.masked_fill(dead[:, None, None, None], 0.0)
    merge_partial_(state, out, lse)
