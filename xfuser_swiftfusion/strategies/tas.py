"""``tas``: topology-aware sequence parallelism without overlap.

Ulysses all-to-all over the (strided, cross-machine) Ulysses group, ring attention over
the (contiguous, intra-machine) Ring group, Ulysses all-to-all back — USP with the two
dimensions swapped (paper section 4.2). Works for every mesh, also where Torus cannot run.

Text tokens: this rank's text queries of head group ``g`` join the ring as one more Q
chunk; text K/V of head group ``g`` are attended once, locally. The text output rides
in the output all-to-all so every rank gets all heads, as in USP.
"""
from __future__ import annotations

import torch

from ..comm.base import TwoSided
from ..groups import SPGroups
from ..kernels import attend, new_state
from .layout import Joint, Slots, gather_output, split_heads
from .registry import StrategySpec, register
from .ring import PassRing


class TasAttention:
    """Callable ``(q, k, v, joint, scale) -> out`` under the USP contract, on any mesh."""

    def __init__(self, groups: SPGroups, comm: TwoSided, rank: int) -> None:
        self.mesh, self.comm, self.comms = groups.mesh, comm, [comm]
        self.ulysses = groups.ulysses_ranks
        self.g = self.ulysses.index(rank)
        ring = groups.ring_ranks
        self.ring = PassRing(comm, ring, ring.index(rank))

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 joint: Joint | None, scale: float) -> torch.Tensor:
        G, g = self.mesh.ulysses, self.g
        S = q.shape[2]
        Tj = joint.length if joint is not None else 0
        # Ulysses all-to-all: [B, H, S, D] -> [G, B, h, S, D] (slot j -> rank j of the group)
        Q, K, V = (self._all_to_all(split_heads(x, G).contiguous(), f"Ulysses all-to-all {n}")
                   for n, x in (("Q", q), ("K", k), ("V", v)))
        q_chunks = list(Q.unbind(0))  # slot j: tokens of Ulysses rank j, head group g
        if joint is not None:
            jq, jk, jv = joint.head_group(g, G)
            q_chunks.append(jq)
        states = [new_state(c) for c in q_chunks]
        if joint is not None:
            attend(q_chunks, [(jk, jv)], states, scale=scale)
        self.ring(q_chunks, states, K, V, scale=scale, what="Ring attention")
        B, h, _, D = Q.shape[1:]
        # G slots: image rows [B, h, S, D], then the (shared) text rows [B, h, Tj, D]
        O = Slots.alloc(Q.new_empty, (G,), B, h, S, Tj, D)
        attend(q_chunks[:G], [], states[:G], scale=scale, finalize=True, out=list(O.rows.unbind(0)))
        if joint is not None:
            (txt,) = attend(q_chunks[G:], [], states[G:], scale=scale, finalize=True)
            O.text[:] = txt  # [B, h, Tj, D] broadcast into every slot
        Ob = Slots.view(self._all_to_all(O.flat, "Ulysses all-to-all O"), B, h, S, Tj, D)
        return gather_output(Ob, joint)  # G slots -> [B, H, S + Tj, D]

    def _all_to_all(self, x: torch.Tensor, what: str) -> torch.Tensor:
        out = torch.empty_like(x)
        self.comm.all_to_all(out, x, self.ulysses, what=what, queue="other")
        return out

    def close(self, failed: bool) -> None:
        """Nothing besides the communicator."""


SPEC = register(StrategySpec(
    "tas", "tas", "Ulysses across machines, Ring inside; all-to-all + two-sided ring, no overlap",
    build=lambda a: TasAttention(a.groups, a.two_sided(), a.rank), order=1))
TasAttention.spec = SPEC

