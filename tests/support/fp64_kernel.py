"""``kernels.attend`` and ``kernels.new_states`` in fp64, written with torch operations alone:
tests put them in place of the kernels (``monkeypatch``) to check a strategy's schedule and
transport to 1e-10 against the fp64 reference."""
from __future__ import annotations

import math

import torch

from xfuser_swiftfusion.kernels import AttnState


def new_state64(q: torch.Tensor) -> AttnState:
    """fp64 running state for queries ``q`` [B, h, L, D]."""
    B, h, L, D = q.shape
    return AttnState(acc=q.new_zeros(B, h, L, D, dtype=torch.float64),
                     m=q.new_full((B, h, L), -math.inf, dtype=torch.float64),
                     l=q.new_zeros(B, h, L, dtype=torch.float64))


def attend64(q_chunks, kv_chunks, states, *, scale, finalize=False, out=None, key_masks=None):
    """``kernels.attend`` in fp64: online softmax over the K/V chunks [B, h, Lk_j, D] joined;
    ``key_masks[j]``: bool [B, Lk_j] (True = attend) or None."""
    if kv_chunks:
        k, v = (torch.cat(x, 2).double() for x in zip(*kv_chunks))  # [B, h_kv, sum Lk_j, D]
        f = q_chunks[0].shape[1] // k.shape[1]  # GQA: query head i reads K/V head i // f
        k, v = k.repeat_interleave(f, dim=1), v.repeat_interleave(f, dim=1)
        keep = None
        if key_masks is not None:
            assert len(key_masks) == len(kv_chunks), (len(key_masks), len(kv_chunks))
            keep = torch.cat([torch.ones(k.shape[0], c.shape[2], dtype=torch.bool) if m is None else m
                              for m, (c, _) in zip(key_masks, kv_chunks)], 1)  # [B, sum Lk_j]
        for q, s in zip(q_chunks, states):
            p = q.double() @ k.transpose(-1, -2) * scale  # [B, h, Lq, Lk]
            if keep is not None:
                p = p.masked_fill(~keep[:, None, None, :], -math.inf)
            m = torch.maximum(s.m, p.amax(-1))
            m0 = m.masked_fill(m == -math.inf, 0.0)  # rows without keys so far: factors 0
            e, f = torch.exp(p - m0.unsqueeze(-1)), torch.exp(s.m - m0)
            s.acc.mul_(f.unsqueeze(-1)).add_(e @ v)
            s.l.mul_(f).add_(e.sum(-1))
            s.m.copy_(m)
    if not finalize:
        return None
    res = [s.acc / s.l.unsqueeze(-1) for s in states]
    if out is not None:
        for o, x in zip(out, res):
            o.copy_(x)
    return res
