"""``usp``: xFuser's own USP, untouched (the baseline), as a strategy of the registry.

Registered through the entry point ``xfuser_swiftfusion.strategies:usp``. It holds the
original ``USP`` function it was given (``BuildArgs.options["xfuser_usp"]``; else xFuser's,
unrouted) and runs it on xFuser's groups: built here from our ``SPGroups`` with the ``usp``
placement when they do not exist (and torn down at close), or checked to have its degrees.

``usp_program`` lists, for the cost model, the calls xFuser 0.7.0's ``USP`` makes (its code,
not ours, executes them): three blocking ``all_to_all_single`` (Q, K, V) over the Ulysses
group, torch's ``_templated_ring_attention`` with its default rotation (K and V concatenated,
all-gathered once over the ring group: issued before step 1's attention, waited before step
2's), one attention call per ring step, and the output ``all_to_all_single``; each
all-to-all with its permute copies before and after.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist

from ...comm import PeerFailure
from ...mesh import Mesh
from ...topology import TopologyError
from ...strategies.layout import Joint
from ...strategies.ops import Attend, Copy, Op, Program, Shape
from ...strategies.registry import BuildArgs, StrategySpec
from . import state


CUDNN_DTYPES = (torch.float16, torch.bfloat16)  # what xFuser's CUDNN backend runs


class UspStrategy:
    """``(q, k, v, joint, scale) -> out`` through xFuser's USP on xFuser's groups."""

    def __init__(self, args: BuildArgs) -> None:
        self.comms: list = []
        self.rank = args.rank
        mesh = args.mesh
        if state.xfuser_parallel_initialized():  # e.g. inside an xFuser run routed by the plugin
            ulysses, ring, _ = state.xfuser_sp_layout()
            if (ulysses, ring) != (mesh.ulysses, mesh.ring):
                raise TopologyError(
                    f"usp: xFuser's parallel state already exists with ulysses {ulysses} x ring "
                    f"{ring}, but ulysses {mesh.ulysses} x ring {mesh.ring} was requested; pass "
                    f"ulysses_degree={ulysses} or destroy xFuser's state first")
            self.owns_state = False  # runs xFuser's USP on the groups it already has
        else:
            state.init_xfuser_parallel(mesh.ulysses, mesh.ring, mesh.placement, args.groups)
            self.owns_state = True
        self.usp: Callable = args.options.get("xfuser_usp") or state.original_usp()

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 joint: Joint | None, scale: float) -> torch.Tensor:
        if scale != 1.0 / math.sqrt(q.shape[-1]):
            raise ValueError("xFuser's USP uses the default softmax scale 1/sqrt(D); "
                             "pass scale=None with strategy='usp'")
        if q.dtype not in CUDNN_DTYPES and state.xfuser_attention_backend() == "CUDNN":
            raise ValueError(
                f"usp: xFuser's CUDNN attention backend (its default on CUDA with cuDNN) takes "
                f"fp16/bf16 and gives NaN for {q.dtype} inputs; run the model in bf16/fp16 or "
                f"choose another backend (xFuser's --attention_backend SDPA_EFFICIENT)")
        jargs = {} if joint is None else dict(joint_query=joint.q, joint_key=joint.k,
                                              joint_value=joint.v, joint_strategy=joint.strategy)
        try:
            return self.usp(q, k, v, **jargs)
        except RuntimeError as exc:
            if isinstance(exc, dist.DistError) or "gloo" in str(exc):
                raise PeerFailure(f"rank {self.rank}: a collective of xFuser's USP failed "
                                  f"(these wait up to the process-group timeout, not timeout_s): "
                                  f"{exc}") from exc
            raise

    def close(self, failed: bool) -> None:
        if self.owns_state:
            self.owns_state = False
            state.destroy_xfuser_parallel()


def usp_program(mesh: Mesh, rank: int, shape: Shape) -> list[Op]:
    """The calls of xFuser's USP on ``rank`` (module docstring); text tokens not modelled."""
    G, R = mesh.ulysses, mesh.ring
    g, r = mesh.g_r_of(rank)
    uly, ring = mesh.ulysses_groups[r], mesh.ring_groups[g]
    X = shape.nbytes(shape.heads, shape.tokens)  # one tensor on one rank, before and after
    bh, rows = shape.batch * shape.heads // G, G * shape.tokens
    prog = Program(rank)

    def all_to_all() -> None:
        prog.add(Copy(X))  # permute(...).contiguous()
        prog.wait(prog.transfer("all_to_all", "other", [(p, X // G) for p in uly],
                                [(p, X // G) for p in uly]))
        prog.add(Copy(X))  # reshape/permute back

    if G > 1:
        for _ in "QKV":
            all_to_all()
    gathered = None
    i = ring.index(rank)
    for step in range(R):
        if step == 0 and R > 1:
            prog.add(Copy(2 * X))  # torch.cat([key.flatten(), value.flatten()])
            gathered = prog.transfer("all_gather", "other", [(ring[(i + 1) % R], 2 * X * (R - 1))],
                                     [(ring[(i - 1) % R], 2 * X * (R - 1))])
        if step == 1:
            prog.wait(gathered)
        prog.add(Attend((rows,), (rows,), bh, finalize=step == R - 1))
    if G > 1:
        all_to_all()
    return prog.ops


def built_ulysses() -> int | None:
    """The Ulysses degree of xFuser's parallel state if it exists in this process (built by
    xFuser, by a ``usp`` context or by one of ``auto``'s children), else None."""
    return state.xfuser_sp_layout()[0] if state.xfuser_parallel_initialized() else None


SPEC = StrategySpec(
    "usp", "usp", "xFuser's own USP, untouched (Ulysses inside machines, Ring across)",
    build=UspStrategy, program=usp_program, baseline=True, external_groups=True,
    built_ulysses=built_ulysses, order=0)
UspStrategy.spec = SPEC
