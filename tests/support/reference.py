"""The fp64 reference attention every test and script compares with.

Independent of the code under test: plain ``softmax(q k^T * scale) v`` in float64 over the
whole sequence, written with torch operations only (nothing from ``xfuser_swiftfusion``).

Layouts: queries ``[B, H, Lq, D]``, keys and values ``[B, H, Lk, D]``; the global sequence of
``world`` ranks is ``L = world * S`` tokens, rank ``r`` holding tokens ``r*S .. (r+1)*S``;
joint (text) tokens ``[B, H, Tj, D]`` are replicated on every rank. Grouped-query attention:
keys and values may have ``H_kv`` heads dividing ``H``, query head i reading head
``i // (H / H_kv)``. Key masks: bool ``[B, Lk]``, True = attend; a query row with no
unmasked key outputs 0 and has LSE ``-inf`` (torch's SDPA outputs 0 there too).
"""
from __future__ import annotations

import torch

Joint = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  scale: float | None = None, key_mask: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 ``softmax(q k^T * scale) v`` ``[B, H, Lq, D]`` and its log-sum-exp ``[B, H, Lq]``.

    ``scale`` defaults to ``D ** -0.5``. Without keys (``Lk = 0``) the output is 0 and the
    LSE is ``-inf``; NaN and inf inputs propagate as fp64 softmax math gives them.
    ``k, v`` may have fewer heads (GQA); ``key_mask`` bool ``[B, Lk]`` drops keys, and rows
    left without keys output 0 with LSE ``-inf``.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    H, Hkv = q.shape[1], k.shape[1]
    assert H % Hkv == 0, (H, Hkv)
    head = torch.arange(H) // (H // Hkv)  # query head i -> its K/V head
    k, v = k.double()[:, head], v.double()[:, head]  # [B, H, Lk, D]
    scores = q.double() @ k.transpose(-1, -2) * scale  # [B, H, Lq, Lk]
    if key_mask is None:
        return torch.softmax(scores, dim=-1) @ v, torch.logsumexp(scores, dim=-1)
    keep = key_mask.to(torch.bool)[:, None, None, :]  # [B, 1, 1, Lk]
    scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # -inf where every key is masked
    p = torch.exp(scores - lse.masked_fill(lse == float("-inf"), 0.0).unsqueeze(-1))
    p = p.masked_fill(~keep, 0.0)  # exactly 0 for masked keys (and rows with none left)
    return p @ v, lse


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              scale: float | None = None, key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """fp64 ``softmax(q k^T * scale) v``: ``[B, H, Lq, D]`` queries over ``[B, H_kv, Lk, D]``
    (``key_mask``: bool ``[B, Lk]``, True = attend)."""
    return attention_lse(q, k, v, scale, key_mask)[0]


def shard(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s tokens ``[B, H, S, D]`` of a global ``[B, H, world * S, D]`` tensor."""
    S = x.shape[2] // world
    return x[:, :, rank * S:(rank + 1) * S]


def rank_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rank: int, world: int,
              joint: Joint | None = None, where: str = "front",
              scale: float | None = None, key_mask: torch.Tensor | None = None,
              joint_key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The fp64 output rows a strategy returns on ``rank``: ``[B, H, Tj + S, D]``.

    ``q, k, v``: the global ``[B, H, world * S, D]`` sequence; ``joint``: text
    ``(jq, jk, jv)`` ``[B, H, Tj, D]`` or None (``Tj = 0``). Every query attends to all text
    and image keys; the text rows come first (``where="front"``) or last (``"rear"``), the
    rank's own image rows in sequence order. ``key_mask`` bool ``[B, world * S]`` masks the
    image keys, ``joint_key_mask`` ``[B, Tj]`` the text keys (None: all attend).
    """
    if where not in ("front", "rear"):
        raise ValueError(f"where must be 'front' or 'rear', not {where!r}")
    if joint is None or joint[0].shape[2] == 0:
        return attention(shard(q, rank, world), k, v, scale, key_mask)
    jq, jk, jv = joint
    keys, values = torch.cat([jk, k], 2), torch.cat([jv, v], 2)
    mask = None
    if key_mask is not None or joint_key_mask is not None:
        B, Tj, L = q.shape[0], jk.shape[2], k.shape[2]
        ones = lambda n: torch.ones(B, n, dtype=torch.bool)  # noqa: E731
        mask = torch.cat([ones(Tj) if joint_key_mask is None else joint_key_mask,
                          ones(L) if key_mask is None else key_mask], 1)  # [B, Tj + L]
    text = attention(jq, keys, values, scale, mask)
    image = attention(shard(q, rank, world), keys, values, scale, mask)
    return torch.cat([text, image] if where == "front" else [image, text], 2)


def max_abs_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``max |out - ref|`` in fp64 (shapes must match)."""
    return (out.double() - ref).abs().max().item()


def layer_inputs(g: torch.Generator, B: int, H: int, Hkv: int, L: int, Tj: int, D: int,
                 dtype: torch.dtype, masked: bool) -> tuple[torch.Tensor, ...]:
    """Random inputs of one layer from ``g``: ``q [B, H, L, D]``, ``k, v [B, Hkv, L, D]``,
    text ``jq [B, H, Tj, D]``, ``jk, jv [B, Hkv, Tj, D]`` and a bool key mask ``[B, L]`` (about
    70 % True; None unless ``masked``), in that order."""
    q = torch.randn(B, H, L, D, generator=g).to(dtype)
    k, v = (torch.randn(B, Hkv, L, D, generator=g).to(dtype) for _ in range(2))
    jq = torch.randn(B, H, Tj, D, generator=g).to(dtype)
    jk, jv = (torch.randn(B, Hkv, Tj, D, generator=g).to(dtype) for _ in range(2))
    mask = (torch.rand(B, L, generator=g) > 0.3) if masked else None
    return q, k, v, jq, jk, jv, mask
