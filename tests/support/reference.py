"""The fp64 reference attention every test and script compares with.

Independent of the code under test: plain ``softmax(q k^T * scale) v`` in float64 over the
whole sequence, written with torch operations only (nothing from ``xfuser_swiftfusion``).

Layouts: queries ``[B, H, Lq, D]``, keys and values ``[B, H, Lk, D]``; the global sequence of
``world`` ranks is ``L = world * S`` tokens, rank ``r`` holding tokens ``r*S .. (r+1)*S``;
joint (text) tokens ``[B, H, Tj, D]`` are replicated on every rank.
"""
from __future__ import annotations

import torch

Joint = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 ``softmax(q k^T * scale) v`` ``[B, H, Lq, D]`` and its log-sum-exp ``[B, H, Lq]``.

    ``scale`` defaults to ``D ** -0.5``. Without keys (``Lk = 0``) the output is 0 and the
    LSE is ``-inf``; NaN and inf inputs propagate as fp64 softmax math gives them.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = q.double() @ k.double().transpose(-1, -2) * scale  # [B, H, Lq, Lk]
    return torch.softmax(scores, dim=-1) @ v.double(), torch.logsumexp(scores, dim=-1)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              scale: float | None = None) -> torch.Tensor:
    """fp64 ``softmax(q k^T * scale) v``: ``[B, H, Lq, D]`` queries over ``[B, H, Lk, D]``."""
    return attention_lse(q, k, v, scale)[0]


def shard(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s tokens ``[B, H, S, D]`` of a global ``[B, H, world * S, D]`` tensor."""
    S = x.shape[2] // world
    return x[:, :, rank * S:(rank + 1) * S]


def rank_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rank: int, world: int,
              joint: Joint | None = None, where: str = "front",
              scale: float | None = None) -> torch.Tensor:
    """The fp64 output rows a strategy returns on ``rank``: ``[B, H, Tj + S, D]``.

    ``q, k, v``: the global ``[B, H, world * S, D]`` sequence; ``joint``: text
    ``(jq, jk, jv)`` ``[B, H, Tj, D]`` or None (``Tj = 0``). Every query attends to all text
    and image keys; the text rows come first (``where="front"``) or last (``"rear"``), the
    rank's own image rows in sequence order.
    """
    if where not in ("front", "rear"):
        raise ValueError(f"where must be 'front' or 'rear', not {where!r}")
    if joint is None or joint[0].shape[2] == 0:
        return attention(shard(q, rank, world), k, v, scale)
    jq, jk, jv = joint
    keys, values = torch.cat([jk, k], 2), torch.cat([jv, v], 2)
    text = attention(jq, keys, values, scale)
    image = attention(shard(q, rank, world), keys, values, scale)
    return torch.cat([text, image] if where == "front" else [image, text], 2)


def max_abs_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``max |out - ref|`` in fp64 (shapes must match)."""
    return (out.double() - ref).abs().max().item()
