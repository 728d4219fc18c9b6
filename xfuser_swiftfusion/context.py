"""Public entry point: ``init_sequence_parallel`` -> ``SequenceParallelContext``.

The data path: topology (machines x GPUs) -> mesh (Ulysses x Ring placement, (t, u, r))
-> communicator (two-sided p2p, or one-sided shm / nvshmem) -> strategy -> ``attention``.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .comm import CommTimeout, OneSided, PeerFailure, make_one_sided, make_two_sided
from .log import get_logger, log_once
from .strategies import STRATEGIES
from .strategies.layout import check_inputs
from .strategies.swiftfusion import OneSidedTorusIO
from .strategies.tas import TasAttention
from .strategies.torus import TorusAttention, TwoSidedTorusIO
from .topology import Mesh, Topology, choose_mesh, detect_topology

logger = get_logger(__name__)

TIMEOUT_ENV = "SWIFTFUSION_TIMEOUT_S"


def default_timeout_s() -> float:
    """``$SWIFTFUSION_TIMEOUT_S``, else 600 s on GPUs and 120 s on CPU."""
    if os.environ.get(TIMEOUT_ENV):
        return float(os.environ[TIMEOUT_ENV])
    return 600.0 if torch.cuda.is_available() else 120.0


@dataclass
class SequenceParallelContext:
    """One strategy bound to the current SP group. ``attention`` follows xFuser's USP contract."""

    strategy: str
    topology: Topology
    mesh: Mesh
    rank: int
    num_heads: int
    timeout_s: float
    _impl: object = field(repr=False)
    _comms: list = field(repr=False, default_factory=list)
    calls: int = 0
    closed: bool = False

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  joint_query: torch.Tensor | None = None, joint_key: torch.Tensor | None = None,
                  joint_value: torch.Tensor | None = None, joint_strategy: str | None = None,
                  scale: float | None = None) -> torch.Tensor:
        """``[B, H, S_local, D]`` in (rank i holds tokens ``[i*S_local, (i+1)*S_local)``),
        ``[B, H, Tj + S_local, D]`` out with text rows ``front`` or ``rear`` (as USP)."""
        if self.closed:
            raise RuntimeError("this SequenceParallelContext was closed")
        joint = check_inputs(q, k, v, self.num_heads, self.mesh.ulysses,
                             joint_query, joint_key, joint_value, joint_strategy)
        scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
        self.calls += 1
        if self.strategy == "usp":
            from .xfuser_state import xfuser_usp
            if scale != 1.0 / math.sqrt(q.shape[-1]):
                raise ValueError("xFuser's USP uses the default softmax scale 1/sqrt(D); "
                                 "pass scale=None with strategy='usp'")
            return xfuser_usp(q, k, v, joint_query, joint_key, joint_value, joint_strategy)
        return self._impl(q, k, v, joint, scale)

    def stats(self) -> dict:
        """Per-rank counters since init or the last ``reset_stats``."""
        intra = sum(c.counter.intra_node_bytes for c in self._comms)
        inter = sum(c.counter.inter_node_bytes for c in self._comms)
        heap = sum(c.symmetric_heap_bytes() for c in self._comms if hasattr(c, "symmetric_heap_bytes"))
        return {"strategy": self.strategy, "mesh": self.mesh.describe(), "calls": self.calls,
                "intra_node_bytes": intra, "inter_node_bytes": inter,
                "symmetric_heap_bytes": heap}

    def reset_stats(self) -> None:
        self.calls = 0
        for c in self._comms:
            c.counter.reset()

    def close(self) -> None:
        """Release communicators and symmetric buffers (idempotent)."""
        if self.closed:
            return
        self.closed = True
        for c in self._comms:
            if isinstance(c, OneSided):
                # peers may still be reading my buffers: wait for them (bounded by the timeout)
                try:
                    c.barrier_all(what="close")
                except (CommTimeout, PeerFailure) as exc:
                    logger.warning(f"rank {self.rank}: closing after a failed final barrier: {exc}")
            c.close()
        if self.strategy == "usp":
            from .xfuser_state import destroy_xfuser_parallel
            destroy_xfuser_parallel()

    def __enter__(self) -> "SequenceParallelContext":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def init_sequence_parallel(strategy: str = "swiftfusion", num_heads: int | None = None,
                           topology: str | Topology | None = None, *,
                           ulysses_degree: int | None = None, ring_degree: int | None = None,
                           timeout_s: float | None = None, comm: str = "auto") -> SequenceParallelContext:
    """Bind ``strategy`` to the default process group (call after ``dist.init_process_group``).

    ``num_heads``: the model's attention heads (fixes the Ulysses degree ``gcd(N*M, H)``
    unless ``ulysses_degree``/``ring_degree`` are given). ``topology``: ``"NxM"`` override of
    the detected machines x GPUs. ``comm``: one-sided backend for ``swiftfusion``
    (``"shm"``, ``"nvshmem"`` or ``"auto"``).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    if num_heads is None:
        raise ValueError("num_heads is required: the Ulysses degree is gcd(world size, num_heads)")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("torch.distributed is not initialised; call dist.init_process_group "
                           "(torchrun) before init_sequence_parallel")
    rank, world = dist.get_rank(), dist.get_world_size()
    topo = detect_topology(world, topology)
    timeout_s = float(timeout_s) if timeout_s is not None else default_timeout_s()
    placement = "usp" if strategy == "usp" else "tas"
    mesh = choose_mesh(topo, num_heads, placement, ulysses_degree, ring_degree)
    if strategy in ("torus", "swiftfusion") and not mesh.torus_ready:
        log_once(logger, f"fallback-{strategy}-{mesh}",
                 f"{strategy}: the Torus schedule needs every ring group inside one machine "
                 f"(ring degree {mesh.ring} must divide {topo.gpus_per_node} GPUs per machine; "
                 f"mesh {mesh.describe()} on {topo}); running 'tas' instead")
        strategy = "tas"
    node_of = [topo.node_of(x) for x in range(world)]
    ctx = SequenceParallelContext(strategy, topo, mesh, rank, num_heads, timeout_s, _impl=None)
    if strategy == "usp":
        from .xfuser_state import init_xfuser_parallel
        init_xfuser_parallel(mesh.ulysses, mesh.ring, "usp")
    elif strategy == "swiftfusion":
        one = make_one_sided(comm, rank=rank, world_size=world, node_of=node_of, timeout_s=timeout_s)
        ctx._comms.append(one)
        one.prepare_groups(mesh.ring_groups)
        ctx._impl = TorusAttention("swiftfusion", mesh, OneSidedTorusIO(mesh, one, rank), rank)
    else:
        two = make_two_sided("p2p", rank=rank, world_size=world, node_of=node_of, timeout_s=timeout_s)
        ctx._comms.append(two)
        if strategy == "tas":
            ctx._impl = TasAttention(mesh, two, rank)
        else:
            ctx._impl = TorusAttention("torus", mesh, TwoSidedTorusIO(mesh, two, rank), rank)
    logger.debug(f"rank {rank}: strategy {strategy}, topology {topo}, mesh {mesh.describe()}")
    return ctx
