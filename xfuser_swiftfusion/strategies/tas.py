"""``tas``: topology-aware sequence parallelism without overlap.

Ulysses all-to-all over the (strided, cross-machine) Ulysses group, ring attention over
the (contiguous, intra-machine) Ring group, Ulysses all-to-all back — USP with the two
dimensions swapped (paper section 4.2). Works for every mesh, also where Torus cannot run.

Text tokens: this rank's text queries of head group ``g`` join the ring as one more Q
chunk; text K/V of head group ``g`` are attended once, locally. The text output rides
in the output all-to-all so every rank gets all heads, as in USP.

Grouped-query attention: K/V all-to-all with ``H_kv / G`` heads per slot (``grouped_kv``).
Key mask: the K/V slot of Ulysses rank j in the block of ring rank r' holds the tokens of
global rank ``mesh.rank_of_g(j, r')``; it is attended with those columns of the mask.

FP8 communication (option ``fp8_comms``): in each all-to-all the slots for Ulysses peers on
other machines travel as ``fp8.py`` wire slots (one scale per slot and tensor, appended to
its bytes), the slots within my machine in the compute dtype, all in the same one exchange.
The ring (inside a machine on every Torus-ready mesh) stays in the compute dtype.

The steps are data: ``tas_schedule(text)`` lists what ``TasAttention`` executes, and
``tas_program`` expands the same list into the cost model's ops (``ops.py``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from .. import plan
from ..comm.base import TwoSided
from ..groups import SPGroups
from ..kernels import attend, new_states
from ..mesh import Mesh
from . import fp8
from .layout import Joint, KeyMask, Slots, gather_output, grouped_kv, split_heads
from .ops import Attend, Copy, Op, Program, Shape
from .planned import PlanCache
from .registry import NATIVE, StrategySpec, register
from .ring import PassRing, ring_ops


@dataclass(frozen=True)
class TasStep:
    """One step of ``tas``: ``all_to_all`` of ``tensor`` (Q, K, V over my Ulysses group, O
    back); ``init``: running states of the query chunks; ``attend_text``: the queries against
    the text K/V; ``ring``: ring attention over my ring group; ``finalize``: outputs = acc / l."""

    kind: Literal["all_to_all", "init", "attend_text", "ring", "finalize"]
    tensor: str = ""


def tas_schedule(text: bool) -> list[TasStep]:
    """The steps of one ``tas`` layer (``text``: with joint tokens)."""
    return [*(TasStep("all_to_all", n) for n in "QKV"), TasStep("init"),
            *([TasStep("attend_text")] if text else []), TasStep("ring"), TasStep("finalize"),
            TasStep("all_to_all", "O")]


class TasAttention:
    """Callable ``(q, k, v, joint, scale) -> out`` under the USP contract, on any mesh, as
    execution plans (``planned.py``: one per input signature)."""

    def __init__(self, groups: SPGroups, comm: TwoSided, rank: int, fp8_comms: bool = False,
                 options: dict | None = None) -> None:
        self.mesh, self.comm, self.comms = groups.mesh, comm, [comm]
        self.ulysses = groups.ulysses_ranks
        self.g = self.ulysses.index(rank)
        node = self.mesh.topology.node_of
        # slots of the all-to-alls that cross machines, sent as FP8 when fp8_comms
        self.remote = [j for j, p in enumerate(self.ulysses) if node(p) != node(rank)] if fp8_comms else []
        self._remote_index: dict[torch.device, torch.Tensor] = {}
        ring = groups.ring_ranks
        self.ring = PassRing(comm, ring, ring.index(rank))
        self.plans = PlanCache.for_strategy(self, options)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 joint: Joint | None, scale: float, key_mask: KeyMask | None = None) -> torch.Tensor:
        """``q`` ``[B, H, S, D]``, ``k, v`` ``[B, H_kv, S, D]`` -> ``[B, H, S (+ Tj), D]``."""
        return self.plans(q, k, v, joint, scale, key_mask)

    def layer(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              joint: Joint | None, scale: float, key_mask: KeyMask | None = None) -> torch.Tensor:
        """One layer's calls (what a plan records)."""
        G, g = self.mesh.ulysses, self.g
        S = q.shape[2]
        Tj = joint.length if joint is not None else 0
        k, v, joint = grouped_kv(k, v, joint, q.shape[1], G, "tas")
        x = {"Q": q, "K": k, "V": v}
        masks = None
        if key_mask is not None and key_mask.tokens is not None:
            def masks(r: int) -> list[torch.Tensor | None]:  # slots of ring rank r's block
                return [key_mask.chunk(self.mesh.rank_of_g(j, r)) for j in range(G)]
        for s in tas_schedule(joint is not None):
            match s.kind:
                case "all_to_all" if s.tensor != "O":
                    # [B, H, S, D] -> [G, B, h, S, D] (slot j -> rank j of the group);
                    # K/V [B, H_kv, S, D] -> [G, B, h_kv, S, D]
                    heads = split_heads(x[s.tensor], G)
                    send = torch.empty(heads.shape, dtype=heads.dtype, device=heads.device)
                    plan.call(lambda send=send, heads=heads: send.copy_(heads))
                    x[s.tensor] = self._all_to_all(send, f"Ulysses all-to-all {s.tensor}")
                case "init":
                    q_chunks = list(x["Q"].unbind(0))  # slot j: tokens of Ulysses rank j, head group g
                    if joint is not None:
                        jq, jk, jv = joint.head_group(g, G)
                        q_chunks.append(jq)
                    states = new_states(q_chunks)
                case "attend_text":
                    attend(q_chunks, [(jk, jv)], states, scale=scale,
                           key_masks=None if key_mask is None else [key_mask.text])
                case "ring":
                    self.ring(q_chunks, states, x["K"], x["V"], scale=scale, what="Ring attention",
                              masks=masks)
                case "finalize":
                    B, h, _, D = x["Q"].shape[1:]
                    # G slots: image rows [B, h, S, D], then the (shared) text rows [B, h, Tj, D]
                    O = Slots.alloc(x["Q"].new_empty, (G,), B, h, S, Tj, D)
                    attend(q_chunks[:G], [], states[:G], scale=scale, finalize=True,
                           out=list(O.rows.unbind(0)))
                    if joint is not None:
                        (txt,) = attend(q_chunks[G:], [], states[G:], scale=scale, finalize=True)
                        text = O.text
                        plan.call(lambda: text.copy_(txt))  # [B, h, Tj, D] broadcast into every slot
                case "all_to_all":
                    Ob = Slots.view(self._all_to_all(O.flat, "Ulysses all-to-all O"), B, h, S, Tj, D)
        return plan.output(lambda: gather_output(Ob, joint))  # G slots -> [B, H, S + Tj, D]

    def _all_to_all(self, x: torch.Tensor, what: str) -> torch.Tensor:
        """``x`` ``[G, ...]``: slot j to Ulysses rank j; slot j of the result from it."""
        out = torch.empty_like(x)
        if not self.remote:
            self.comm.all_to_all(out, x, self.ulysses, what=what, queue="other")
            return out
        # one exchange as all_to_all, the slots of other machines as FP8 wire slots
        idx = self._remote_index.get(x.device)
        if idx is None:
            with plan.preparing():
                idx = self._remote_index[x.device] = torch.tensor(self.remote, device=x.device)
        m = x[0].numel()
        send = fp8.wire_empty(lambda s, d: torch.empty(s, dtype=d, device=x.device), (len(idx),), m)
        # [n_remote, ...] -> [n_remote, m + 4] bytes
        plan.call(lambda: fp8.quantize_(send, x.index_select(0, idx)))
        recv = torch.empty_like(send)
        wire = dict(zip(self.remote, zip(send.unbind(0), recv.unbind(0))))
        sends = [(wire[j][0] if j in wire else x[j], p) for j, p in enumerate(self.ulysses)]
        recvs = [(wire[j][1] if j in wire else out[j], p) for j, p in enumerate(self.ulysses)]
        self.comm.exchange(sends, recvs, what=what + " (fp8 across machines)", queue="other").wait()
        arrived = torch.empty((len(idx), *x.shape[1:]), dtype=x.dtype, device=x.device)

        def unpack() -> None:
            fp8.dequantize_(recv, arrived)  # [n_remote, m + 4] bytes -> [n_remote, ...]
            out.index_copy_(0, idx, arrived)

        plan.call(unpack)
        return out

    def close(self, failed: bool) -> None:
        """Nothing besides the communicator."""


def tas_program(mesh: Mesh, rank: int, shape: Shape) -> list[Op]:
    """The ops of ``tas_schedule`` on ``rank`` (``TasAttention`` over ``P2PCommunicator``)."""
    G, R = mesh.ulysses, mesh.ring
    g, r = mesh.g_r_of(rank)
    uly, ring = mesh.ulysses_groups[r], mesh.ring_groups[g]
    h, S, Tj = shape.heads // G, shape.tokens, shape.text
    bh, slot = shape.batch * h, shape.nbytes(h, S)
    q_rows = (S,) * G + ((Tj,) if Tj else ())
    prog = Program(rank)
    for s in tas_schedule(bool(Tj)):
        match s.kind:
            case "all_to_all":
                n = shape.nbytes(h, S + Tj) if s.tensor == "O" else slot
                if s.tensor != "O":
                    prog.add(Copy(G * slot))  # split_heads(...).contiguous()
                prog.wait(prog.transfer("exchange", "other", [(p, n) for p in uly],
                                        [(p, n) for p in uly]))
            case "init":
                prog.add(*(Copy(shape.state_bytes(h, n)) for n in q_rows))
            case "attend_text":
                prog.add(Attend(q_rows, (Tj,), bh))
            case "ring":
                ring_ops(prog, PassRing, ring, ring.index(rank), q_rows, (S,) * G, bh,
                         (G * slot, G * slot))
            case "finalize":
                prog.add(Attend((S,) * G, (), bh, finalize=True))
                if Tj:
                    prog.add(Attend((Tj,), (), bh, finalize=True))
    prog.add(Copy(G * shape.nbytes(h, S + Tj)))  # gather_output
    return prog.ops


SPEC = register(StrategySpec(
    "tas", "tas", "Ulysses across machines, Ring inside; all-to-all + two-sided ring, no overlap",
    build=lambda a: TasAttention(a.groups, a.two_sided(), a.rank, fp8.enabled(a.options), a.options),
    program=tas_program, order=1, native=NATIVE))
TasAttention.spec = SPEC

