"""``usp``: xFuser's own USP, untouched (the baseline), as a strategy of the registry.

Registered through the entry point ``xfuser_swiftfusion.strategies:usp``. It holds the
original ``USP`` function it was given (``BuildArgs.options["xfuser_usp"]``; else xFuser's,
unrouted) and runs it on xFuser's groups: built here from our ``SPGroups`` with the ``usp``
placement when they do not exist (and torn down at close), or checked to have its degrees.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist

from ...comm import PeerFailure
from ...topology import TopologyError
from ...strategies.layout import Joint
from ...strategies.registry import BuildArgs, StrategySpec
from . import state


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


SPEC = StrategySpec(
    "usp", "usp", "xFuser's own USP, untouched (Ulysses inside machines, Ring across)",
    build=UspStrategy, schedule="ulysses-gather", baseline=True, external_groups=True, order=0)
UspStrategy.spec = SPEC
