"""xFuser's USP on rank 0 of a cluster, on one GPU: the replay stage's baseline row.

xFuser 0.7's ``USP`` on N x M GPUs runs Ulysses inside a machine (degree ``U = gcd(M, H)``
with the ``usp`` placement) and Ring across machines (``R = N*M / U``). On rank 0 a layer is:

1. text (CogVideoX's joint tensors) concatenated to the local queries ``[1, H, S + Tj, D]``;
2. the Ulysses all-to-all of Q, K and V (``_ft_c_input_all_to_all``: a ``permute(...)
   .contiguous()`` copy, ``all_to_all_single``, a permute-reshape copy back):
   ``[1, H, S', D] -> [1, H / U, U * S', D]``;
3. ring attention (torch's ``_templated_ring_attention``, its default rotation: K/V of the
   ring group all-gathered once), one attention call with log-sum-exp per ring block, the text
   K/V joining the first block's keys; each call's ``(out, lse)`` merged by torch's
   ``_SDPAMerger`` (the sigmoid / logsigmoid update) in fp32;
4. the output all-to-all back (the same copies).

Here every collective is a device-to-device copy of the bytes it moves on rank 0 (each peer's
slot holds this rank's own data, as ``ReplayComm`` does for our transfers), and the attention
op is the one xFuser runs on the GPU (``ops``: cuDNN on Hopper, flash-attn where installed,
torch's flash attention; the CPU op on CPU stand-ins).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


def _merger_class():
    """torch's ``_SDPAMerger`` (its module moved between torch releases)."""
    try:
        from torch.distributed.tensor.experimental._context_parallel._attention import _SDPAMerger
    except ImportError:
        from torch.distributed.tensor.experimental._attention import _SDPAMerger
    return _SDPAMerger


# (q, k, v [B, H, L, D], scale) -> (out [B, H, Lq, D], lse [B, H, >= Lq] or [B, H, Lq, 1])
AttnOp = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]


def _a2a_in(x: torch.Tensor, U: int) -> torch.Tensor:
    """``_ft_c_input_all_to_all`` on one GPU: ``[b, h, s, d] -> [b, h / U, U * s, d]``."""
    b, h, s, d = x.shape
    x = x.permute(1, 0, 2, 3).contiguous()          # [h, b, s, d]
    y = torch.empty_like(x)
    y.copy_(x)                                       # all_to_all_single: the bytes it moves
    return y.reshape(U, h // U, b, s, d).permute(2, 1, 0, 3, 4).reshape(b, h // U, U * s, d)


def _a2a_out(x: torch.Tensor, U: int) -> torch.Tensor:
    """The output all-to-all: ``[b, h / U, U * s, d] -> [b, h, s, d]`` (a permute copy, the
    transfer, a permute copy)."""
    b, hu, us, d = x.shape
    s = us // U
    x = x.reshape(b, hu, U, s, d).permute(2, 1, 0, 3, 4).contiguous()  # [U, h/U, b, s, d]
    y = torch.empty_like(x)
    y.copy_(x)
    return y.reshape(U * hu, b, s, d).permute(1, 0, 2, 3).contiguous()


@dataclass
class UspLayer:
    """Rank 0's USP layer (module docstring): ``q, k, v`` ``[1, H, S, D]``, text ``jq, jk, jv``
    ``[1, H, Tj, D]`` (or None), Ulysses ``U`` x Ring ``R``; ``op`` the attention call."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    joint: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    U: int
    R: int
    scale: float
    op: AttnOp
    collectives: bool = True  # False: the attention calls and merges alone (USP's compute)

    def __call__(self) -> torch.Tensor:
        U = self.U
        q, k, v = self.q, self.k, self.v
        if self.joint is not None:  # xFuser concatenates the text queries before the all-to-all
            q = torch.cat([self.joint[0], q], dim=2)
        if not self.collectives:  # the shapes after the all-to-alls, none of their copies
            return self._ring(*(x.reshape(1, x.shape[1] // U, U * x.shape[2], x.shape[3])
                                for x in (q, k, v)))
        q, k, v = _a2a_in(q, U), _a2a_in(k, U), _a2a_in(v, U)   # [1, H/U, U*S(+Tj), D]
        return _a2a_out(self._ring(q, k, v), U)  # text rows ride along, as in xFuser

    def _ring(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Ring attention of ``q`` against ``R`` blocks like ``k, v`` (``[1, H/U, L, D]``)."""
        R = self.R
        if R > 1 and self.collectives:  # torch's default rotation: K/V of the ring all-gathered once
            kv = torch.cat([k, v]).flatten()
            gathered = torch.empty(R - 1, kv.numel(), dtype=kv.dtype, device=kv.device)
            gathered.copy_(kv.expand(R - 1, -1))
        merger = _merger_class()(True, 2)
        h = k.shape[1]
        for step in range(R):
            kb, vb = k, v  # every ring block holds this rank's data (one GPU stands for the ring)
            if step == 0 and self.joint is not None:  # the text K/V join the first block
                g0 = slice(0, h)  # rank 0's Ulysses heads
                kb = torch.cat([self.joint[1][:, g0], k], dim=2)
                vb = torch.cat([self.joint[2][:, g0], v], dim=2)
            out, lse = self.op(q, kb, vb, self.scale)
            merger.step(out, lse[..., :q.shape[2]] if lse.dim() == 3 else lse, False)
        return merger.results()[0]


def build_usp(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              joint: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, U: int, R: int,
              scale: float, op: AttnOp, collectives: bool = True) -> UspLayer:
    """``UspLayer`` for rank 0's inputs; ``U`` must divide the heads."""
    if q.shape[1] % U:
        raise ValueError(f"USP: {q.shape[1]} heads do not split over Ulysses degree {U}")
    return UspLayer(q, k, v, joint, U, R, scale, op, collectives)


__all__ = ["UspLayer", "build_usp"]
