"""diffusers' attention masks under context parallelism, read as the key-padding masks the
strategies apply (``ctx.attention(key_mask=)``, ``strategies/layout.py``'s ``KeyMask``).

What diffusers' processors pass as ``attn_mask`` for local queries ``[B, S_q, H, D]`` and
keys ``[B, S_kv, H_kv, D]``:

- ``[B, S_kv]`` (diffusers' native backend reads it as ``[B, 1, 1, S_kv]``), or any shape
  torch's SDPA broadcasts to ``[B, H, S_q, S_kv]``: Qwen-Image's ``[B, 1, 1, S_kv]``, LTX's
  ``[B, H, 1, S_kv]`` (its text mask repeated per head);
- bool (True = attend) or additive float: 0 attends, a value ``<= MASKED_AT`` (-1e3, -inf
  included; LTX's -10000 is -9984 in bf16) masks. Its weight ``exp(s - s_max - 1e3)`` is 0 in
  fp32 (below ``e^-104``) wherever the row's scores span less than ~900, so such a key adds
  exactly nothing to a row that has an unmasked key; any other value is a bias, not a mask;
- over this rank's keys (the plan split the mask with the tokens: last dimension ``S_kv``) or
  over every rank's keys (a mask the plan does not split: ``W * S_kv``, the same on every
  rank). A query dimension of ``W * S_q`` (a whole-sequence mask) is cut to this rank's rows.

A mask constant along heads and queries is a key mask in disguise: its ``[B, S_kv]`` row is
all the strategies need. The check reads the mask as given (dimensions of size 1 or stride 0
are not read twice); nothing is expanded to ``[B, H, S_q, S_kv]``. Rows whose keys are all
masked output 0 on the strategies (as ``ctx.attention``); diffusers' pipelines never build
one (every prompt keeps a token, and image tokens are never masked).

``agreed_key_mask`` makes one decision for all ranks: a mask over local keys travels in one
all-gather of ``W x B x (S_kv + 1)`` bytes (the mask and this rank's verdict), so every rank
sees the same whole-sequence mask and the same verdicts and takes the same path; a mask
over every rank's keys is the same on every rank and needs no exchange. An all-ones result
is None: the strategy then runs unmasked (its unmasked kernels, no mask traffic).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

MASKED_AT = -1.0e3  # additive mask values at or below this mask their key
# verdict codes of one rank's mask (sent with it; any rank's failure fails the call on all)
_OK, _VARIES, _BIAS = 0, 1, 2
VERDICTS = {_VARIES: "an attention mask that varies along heads or queries (not a key mask)",
            _BIAS: f"an additive attention mask with values other than 0 and <= {MASKED_AT:g} "
                   "(a bias, not a key mask)"}


class MaskShapeError(ValueError):
    """A mask whose shape fits neither this rank's keys nor every rank's keys."""


@dataclass(frozen=True)
class LocalMask:
    """An attention mask cut to this rank's queries: ``m`` 4-D ``[b, h, q, K]`` with ``b`` in
    (1, B), ``h`` in (1, H), ``q`` in (1, S_q) and ``K`` the key extent: ``S_kv`` (this rank's
    keys, ``whole=False``) or ``W * S_kv`` (every rank's keys in rank order, ``whole=True``).
    ``uncut``: ``m`` before its query rows were cut (a whole-sequence mask's verdict is taken
    on every rank's rows, so that it is the same on every rank)."""

    m: torch.Tensor
    whole: bool
    uncut: torch.Tensor


def localize(mask: torch.Tensor, B: int, H: int, S_q: int, S_kv: int, world: int,
             rank: int) -> LocalMask:
    """``mask`` as a ``LocalMask`` (``MaskShapeError`` naming the shape if it fits neither
    extent). Views only."""
    m = mask
    if m.dim() == 2 and tuple(m.shape) in ((B, S_kv), (B, world * S_kv)):
        m = m[:, None, None, :]  # [B, K] -> [B, 1, 1, K], as diffusers' native backend reads it
    if not 1 <= m.dim() <= 4:
        raise MaskShapeError(f"a {m.dim()}-D attention mask {tuple(mask.shape)}")
    m = m.reshape((1,) * (4 - m.dim()) + tuple(m.shape))  # left-aligned as SDPA broadcasts
    uncut = m
    b, h, q, K = m.shape
    if q == world * S_q and q != S_q:  # a whole-sequence mask: this rank's query rows
        m, q = m[:, :, rank * S_q:(rank + 1) * S_q], S_q
    if b not in (1, B) or h not in (1, H) or q not in (1, S_q) or K not in (S_kv, world * S_kv):
        raise MaskShapeError(
            f"an attention mask {tuple(mask.shape)} that broadcasts neither to this rank's "
            f"[B={B}, H={H}, S_q={S_q}, S_kv={S_kv}] nor to every rank's keys "
            f"[B, H, S_q, {world}x{S_kv}]")
    return LocalMask(m, K != S_kv, uncut)


def _constant_row(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(``m[:, 0, 0]`` ``[b, K]``, 0-dim bool tensor: ``m`` is constant along heads and
    queries). Dimensions of size 1 or stride 0 are taken as they are (not read)."""
    for d in (1, 2):
        if m.shape[d] > 1 and m.stride(d) == 0:
            m = m.narrow(d, 0, 1)
    first = m[:, :1, :1]  # [b, 1, 1, K]
    if m.shape[1] == m.shape[2] == 1:
        return first[:, 0, 0], torch.ones((), dtype=torch.bool, device=m.device)
    return first[:, 0, 0], (m == first).all()


def key_mask_and_verdict(m: torch.Tensor, B: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(bool ``[B, K]`` key mask, 0-dim uint8 verdict code) of a 4-D mask ``m`` ``[b, h, q, K]``;
    the key mask is meaningful only where the verdict is ``_OK``. No host synchronisation."""
    row, constant = _constant_row(m)
    if m.dtype == torch.bool:
        keys, valid = row, torch.ones((), dtype=torch.bool, device=m.device)
    else:
        keys = row == 0
        valid = (keys | (row <= MASKED_AT)).all()
    code = torch.where(constant, torch.where(valid, _OK, _BIAS), _VARIES).to(torch.uint8)
    return keys.expand(B, -1), code


def agreed_key_mask(local: LocalMask, B: int, S_kv: int, world: int
                    ) -> tuple[torch.Tensor | None, str | None]:
    """(whole-sequence key mask ``[B, world * S_kv]`` bool, or None for all-ones; the reason
    it is no key mask, or None), the same on every rank. A mask over local keys is
    all-gathered with each rank's verdict (collective over the default group)."""
    keys, code = key_mask_and_verdict(local.uncut if local.whole else local.m, B)
    if local.whole:  # the same tensor on every rank: a local decision is everyone's
        codes, every = code.view(1), keys
    else:
        # [B, S_kv] keys + verdict -> one uint8 row per rank: [world, B * S_kv + 1]
        mine = torch.cat([keys.reshape(-1).to(torch.uint8), code.view(1)])
        rows = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(rows, mine)
        gathered = torch.stack(rows)
        codes = gathered[:, -1]
        # [world, B, S_kv] -> [B, world, S_kv] -> [B, world * S_kv]: rank order along the keys
        every = gathered[:, :-1].view(world, B, S_kv).transpose(0, 1).reshape(B, world * S_kv).bool()
    verdicts = torch.cat([codes.to(torch.int64), every.all().view(1).to(torch.int64)]).tolist()
    bad = max(verdicts[:-1])
    if bad != _OK:
        return None, VERDICTS[bad]
    return (None if verdicts[-1] else every), None


def local_columns(key_mask: torch.Tensor | None, rank: int, S_kv: int) -> torch.Tensor | None:
    """This rank's keys of a whole-sequence key mask ``[B, W * S_kv]``: ``[B, S_kv]`` view."""
    return None if key_mask is None else key_mask[:, rank * S_kv:(rank + 1) * S_kv]


__all__ = ["MASKED_AT", "LocalMask", "MaskShapeError", "VERDICTS", "agreed_key_mask",
           "key_mask_and_verdict", "local_columns", "localize"]
