"""Public entry point: ``init_sequence_parallel`` -> ``SequenceParallelContext``.

The data path: topology (machines x GPUs) -> mesh (Ulysses x Ring placement, (t, u, r))
-> communicator (two-sided p2p, or one-sided shm / nvshmem) -> strategy -> ``attention``.
"""
from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from .comm import CommTimeout, OneSided, PeerFailure, make_one_sided, make_two_sided
from .log import get_logger, log_once
from .strategies import STRATEGIES
from .strategies.layout import InputError, Joint, check_inputs
from .strategies.swiftfusion import OneSidedTorusIO
from .strategies.tas import TasAttention
from .strategies.torus import TorusAttention, TwoSidedTorusIO
from .topology import Mesh, Topology, TopologyError, choose_mesh, detect_topology

logger = get_logger(__name__)

TIMEOUT_ENV = "SWIFTFUSION_TIMEOUT_S"

# fields of the per-call input signature every rank must agree on (see ``_check_uniform``)
_SIGNATURE = ("batch B", "heads H", "local sequence length S_local", "head dim D", "dtype",
              "joint (text) tokens", "joint_strategy", "softmax scale")
_JOINT_CODES = (None, "front", "rear")
_DTYPE_CODES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _signature(q: torch.Tensor, joint: Joint | None, scale: float) -> tuple[float, ...]:
    """The ``_SIGNATURE`` fields of one call, as numbers (dtype: index in ``_DTYPE_CODES``)."""
    dtype = _DTYPE_CODES.index(q.dtype) if q.dtype in _DTYPE_CODES else len(_DTYPE_CODES)
    return (*q.shape, dtype, joint.length if joint else -1,
            _JOINT_CODES.index(joint.strategy if joint else None), scale)


def _show(field_index: int, x: float) -> str:
    """One signature field, readable."""
    name = _SIGNATURE[field_index]
    if name == "dtype":
        return str(_DTYPE_CODES[int(x)]).removeprefix("torch.") if x < len(_DTYPE_CODES) else "other"
    if name == "joint (text) tokens":
        return "none" if x < 0 else str(int(x))
    if name == "joint_strategy":
        return str(_JOINT_CODES[int(x)])
    return f"{x:g}" if name == "softmax scale" else str(int(x))


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
    # reason -> calls handed to xFuser's own USP by the xFuser hook (xfuser_plugin)
    fallbacks: dict = field(default_factory=dict)
    # False when xFuser's parallel state was built by someone else (close leaves it alone)
    owns_xfuser_state: bool = True
    failed: bool = False  # a call raised: peers may be mid-layer, so close skips the final barrier
    _checked: set = field(repr=False, default_factory=set)

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
        if self.strategy == "usp" and scale != 1.0 / math.sqrt(q.shape[-1]):
            raise ValueError("xFuser's USP uses the default softmax scale 1/sqrt(D); "
                             "pass scale=None with strategy='usp'")
        self._check_uniform(q, joint, scale)
        self.calls += 1
        try:
            if self.strategy == "usp":
                from .xfuser_state import xfuser_usp
                return xfuser_usp(q, k, v, joint_query, joint_key, joint_value, joint_strategy)
            return self._impl(q, k, v, joint, scale)
        except (CommTimeout, PeerFailure) as exc:
            self.failed = True
            raise type(exc)(f"{self.strategy}: {exc}") from exc
        except RuntimeError as exc:
            self.failed = True
            if self.strategy == "usp" and (isinstance(exc, dist.DistError) or "gloo" in str(exc)):
                raise PeerFailure(f"usp: rank {self.rank}: a collective of xFuser's USP failed "
                                  f"(these wait up to the process-group timeout, not timeout_s): "
                                  f"{exc}") from exc
            raise
        except BaseException:
            self.failed = True
            raise

    def _check_uniform(self, q: torch.Tensor, joint: Joint | None, scale: float) -> None:
        """Collective on the first call with each input signature (one all-gather of 8 numbers):
        every rank must pass the same B, H, S_local, D, dtype, joint tokens and scale.
        A mismatch is an ``InputError`` naming the field and each rank's value, instead of a
        transport abort (gloo kills the process on a message-size mismatch) or a wrong result.
        A rank that alone changes its shapes waits here for at most ``timeout_s`` (``CommTimeout``)."""
        sig = _signature(q, joint, scale)
        if sig in self._checked:
            return
        device = q.device if dist.get_backend() == "nccl" else torch.device("cpu")
        mine = torch.tensor(sig, dtype=torch.float64, device=device)
        rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        work = dist.all_gather(rows, mine, async_op=True)
        try:
            work.wait(timeout=timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:
            self.failed = True
            doing = (f"{self.strategy}: rank {self.rank}: 'input check' (first call with query "
                     f"{tuple(q.shape)} {q.dtype})")
            if "timed out" not in str(exc).lower():
                raise PeerFailure(f"{doing}: all-gather of input shapes failed: {exc}") from exc
            raise CommTimeout(f"{doing}: the other ranks did not join within {self.timeout_s:.1f} s; "
                              "every rank must call attention with the same shapes, in the same "
                              "order") from exc
        rows = [tuple(r.tolist()) for r in rows]
        bad = [i for i in range(len(sig)) if len({r[i] for r in rows}) > 1]
        if bad:
            diff = "; ".join(f"{_SIGNATURE[i]}: " + ", ".join(f"rank {r}={_show(i, row[i])}"
                                                              for r, row in enumerate(rows))
                             for i in bad)
            raise InputError(
                f"{self.strategy}: inputs differ across the {len(rows)} ranks of the SP group "
                f"({diff}). Every rank must pass query/key/value [B, H, S_local, D] with the same "
                f"B, H, D, dtype and the same S_local = L / {len(rows)} (pad the sequence to a "
                "multiple of the SP degree), and the same joint tensors and scale.")
        self._checked.add(sig)

    def stats(self) -> dict:
        """Per-rank counters since init or the last ``reset_stats``."""
        intra = sum(c.counter.intra_node_bytes for c in self._comms)
        inter = sum(c.counter.inter_node_bytes for c in self._comms)
        heap = sum(c.symmetric_heap_bytes() for c in self._comms if hasattr(c, "symmetric_heap_bytes"))
        return {"strategy": self.strategy, "mesh": self.mesh.describe(), "calls": self.calls,
                "intra_node_bytes": intra, "inter_node_bytes": inter,
                "symmetric_heap_bytes": heap, "fallbacks": dict(self.fallbacks)}

    def reset_stats(self) -> None:
        self.calls = 0
        self.fallbacks.clear()
        for c in self._comms:
            c.counter.reset()

    def close(self) -> None:
        """Release communicators and symmetric buffers (idempotent)."""
        if self.closed:
            return
        self.closed = True
        if self.strategy == "auto":
            self._impl.close()
        for c in self._comms:
            if isinstance(c, OneSided) and self.failed:
                # a mid-layer peer would pair its own barrier with this one and go on with
                # missing data: close without it, peers then see a closed rank (PeerFailure)
                logger.warning(f"rank {self.rank}: closing {self.strategy} after a failed call, "
                               "without the final barrier")
            elif isinstance(c, OneSided):
                # peers may still be reading my buffers: wait for them (bounded by the timeout)
                try:
                    c.barrier_all(what="close")
                except (CommTimeout, PeerFailure) as exc:
                    logger.warning(f"rank {self.rank}: closing after a failed final barrier: {exc}")
            c.close()
        if self.strategy == "usp" and self.owns_xfuser_state:
            from .xfuser_state import destroy_xfuser_parallel
            destroy_xfuser_parallel()

    def __enter__(self) -> "SequenceParallelContext":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None:
            self.failed = True
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
    if strategy == "auto":  # decided lazily at the first call of each input shape
        from .strategies.auto import AutoAttention
        ctx = SequenceParallelContext("auto", topo, mesh, rank, num_heads, timeout_s, _impl=None)
        ctx._impl = AutoAttention(topo, num_heads, rank, lambda s, u: init_sequence_parallel(
            s, num_heads, topo, ulysses_degree=u, timeout_s=timeout_s, comm=comm), ctx._comms)
        return ctx
    if strategy in ("torus", "swiftfusion") and not mesh.torus_ready:
        log_once(logger, f"fallback-{strategy}-{mesh}",
                 f"{strategy}: the Torus schedule needs every ring group inside one machine "
                 f"(ring degree {mesh.ring} must divide {topo.gpus_per_node} GPUs per machine; "
                 f"mesh {mesh.describe()} on {topo}); running 'tas' instead")
        strategy = "tas"
    if strategy == "swiftfusion" and comm == "auto" and torch.cuda.is_available():
        missing = [None] * world  # decided together: one rank alone falling back would hang
        dist.all_gather_object(missing, importlib.util.find_spec("nvshmem") is None)
        if any(missing):
            log_once(logger, "fallback-swiftfusion-nvshmem",
                     "swiftfusion: comm='auto' needs NVSHMEM on GPUs but nvshmem4py is not "
                     f"installed on ranks {[r for r, m in enumerate(missing) if m]} "
                     "(pip install nvshmem4py-cu13); running 'torus' (two-sided) instead")
            strategy = "torus"
    node_of = [topo.node_of(x) for x in range(world)]
    ctx = SequenceParallelContext(strategy, topo, mesh, rank, num_heads, timeout_s, _impl=None)
    if strategy == "usp":
        from .xfuser_state import init_xfuser_parallel, xfuser_parallel_initialized, xfuser_sp_layout
        if xfuser_parallel_initialized():  # e.g. inside an xFuser run routed by the plugin
            ulysses, ring, _ = xfuser_sp_layout()
            if (ulysses, ring) != (mesh.ulysses, mesh.ring):
                raise TopologyError(
                    f"usp: xFuser's parallel state already exists with ulysses {ulysses} x ring "
                    f"{ring}, but ulysses {mesh.ulysses} x ring {mesh.ring} was requested; pass "
                    f"ulysses_degree={ulysses} or destroy xFuser's state first")
            ctx.owns_xfuser_state = False  # runs xFuser's USP on the groups it already has
        else:
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
