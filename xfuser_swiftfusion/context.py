"""Public entry point: ``init_sequence_parallel`` -> ``SequenceParallelContext``.

The data path: topology (machines x GPUs) -> mesh (Ulysses x Ring placement, (t, u, r)) ->
groups (``DeviceMesh``) -> communicator (two-sided p2p, or a one-sided backend) -> strategy
(built by its registry spec) -> ``attention``.
"""
from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from .comm import CommTimeout, OneSided, PeerFailure, make_one_sided, make_two_sided
from .distributed import check_device
from .groups import build_groups
from .kernels import attend_calls
from .log import get_logger
from .mesh import Mesh, choose_mesh
from .strategies import BuildArgs, Strategy, get
from .strategies.layout import InputError, Joint, KeyMask, check_inputs, check_key_mask
from .strategies.planned import plan_stats
from .strategies.registry import call_args
from .topology import Topology, detect_topology

logger = get_logger(__name__)

TIMEOUT_ENV = "SWIFTFUSION_TIMEOUT_S"

# fields of the per-call input signature every rank must agree on (see ``_check_uniform``)
_SIGNATURE = ("batch B", "heads H", "local sequence length S_local", "head dim D", "dtype",
              "joint (text) tokens", "joint_strategy", "softmax scale", "K/V heads H_kv",
              "key mask")
_MASK_CODES = ("none", "tokens", "text", "tokens and text")
_JOINT_CODES = (None, "front", "rear")
_DTYPE_CODES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _signature(q: torch.Tensor, joint: Joint | None, scale: float, heads_kv: int | None = None,
               key_mask: KeyMask | None = None) -> tuple[float, ...]:
    """The ``_SIGNATURE`` fields of one call, as numbers (dtype: index in ``_DTYPE_CODES``;
    key mask: index in ``_MASK_CODES``). The mask's values are not compared: it must be the
    same (replicated) tensor on every rank."""
    dtype = _DTYPE_CODES.index(q.dtype) if q.dtype in _DTYPE_CODES else len(_DTYPE_CODES)
    mask = 0 if key_mask is None else (key_mask.tokens is not None) + 2 * (key_mask.text is not None)
    return (*q.shape, dtype, joint.length if joint else -1,
            _JOINT_CODES.index(joint.strategy if joint else None), scale,
            q.shape[1] if heads_kv is None else heads_kv, mask)


def _show(field_index: int, x: float) -> str:
    """One signature field, readable."""
    name = _SIGNATURE[field_index]
    if name == "dtype":
        return str(_DTYPE_CODES[int(x)]).removeprefix("torch.") if x < len(_DTYPE_CODES) else "other"
    if name == "joint (text) tokens":
        return "none" if x < 0 else str(int(x))
    if name == "joint_strategy":
        return str(_JOINT_CODES[int(x)])
    if name == "key mask":
        return _MASK_CODES[int(x)]
    return f"{x:g}" if name == "softmax scale" else str(int(x))


def default_timeout_s() -> float:
    """``$SWIFTFUSION_TIMEOUT_S``, else 600 s on GPUs and 120 s on CPU."""
    if os.environ.get(TIMEOUT_ENV):
        return float(os.environ[TIMEOUT_ENV])
    return 600.0 if torch.cuda.is_available() else 120.0


@dataclass
class SequenceParallelContext:
    """One strategy bound to the current SP group. ``attention`` follows xFuser's USP contract."""

    strategy: str          # the strategy that runs (after its spec's fallback)
    topology: Topology
    mesh: Mesh
    rank: int
    num_heads: int
    timeout_s: float
    _impl: Strategy = field(repr=False)
    calls: int = 0
    closed: bool = False
    # reason -> calls an integration handed to another attention (e.g. xFuser's own USP)
    fallbacks: dict = field(default_factory=dict)
    failed: bool = False  # a call raised: peers may be mid-layer, so close skips the final barrier
    # global rank of each SP rank when the SP group is a subset of the world (CFG halves)
    members: tuple[int, ...] | None = None
    _checked: set = field(repr=False, default_factory=set)
    _attends: int = field(repr=False, default=0)  # local attention calls inside my calls
    _fallback_lock: threading.Lock = field(repr=False, default_factory=threading.Lock)

    def record_fallback(self, reason: str) -> None:
        """An integration handed one call elsewhere for ``reason`` (thread-safe count)."""
        with self._fallback_lock:
            self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1

    @property
    def _comms(self) -> list:
        return self._impl.comms

    # torch.compile: one graph break per call; nothing below (streams, one-sided puts, host
    # threads, per-call counters) is traced, guarded on or reordered
    @torch.compiler.disable(recursive=True, reason="sequence-parallel attention runs eagerly")
    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  joint_query: torch.Tensor | None = None, joint_key: torch.Tensor | None = None,
                  joint_value: torch.Tensor | None = None, joint_strategy: str | None = None,
                  scale: float | None = None, *, kv_head_repeat: int | None = None,
                  key_mask: torch.Tensor | None = None,
                  joint_key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, H, S_local, D]`` in (rank i holds tokens ``[i*S_local, (i+1)*S_local)``),
        ``[B, H, Tj + S_local, D]`` out with text rows ``front`` or ``rear`` (as USP).

        Grouped-query attention: ``k, v`` (and ``joint_key/value``) ``[B, H_kv, ., D]`` with
        H_kv dividing H, query head i using K/V head ``i // (H / H_kv)``; ``kv_head_repeat``
        (xFuser's name for H / H_kv), when given, must agree. ``key_mask``: bool ``[B, L]``
        or ``[B, 1, 1, L]`` over the whole sharded sequence (``L = world * S_local``, True =
        attend), the same on every rank; ``joint_key_mask``: bool ``[B, Tj]`` over the text
        keys. Query rows whose keys are all masked output 0 (as torch's SDPA)."""
        if self.closed:
            raise RuntimeError("this SequenceParallelContext was closed")
        # H % P_u holds by construction: choose_mesh checked num_heads at init, or the
        # strategy runs on zero-padded heads (strategies/padded.py) and takes any H
        joint = check_inputs(q, k, v, self.num_heads, 1,
                             joint_query, joint_key, joint_value, joint_strategy)
        if kv_head_repeat is not None and k.shape[1] * kv_head_repeat != q.shape[1]:
            raise InputError(f"kv_head_repeat={kv_head_repeat} but query has {q.shape[1]} heads and "
                             f"key/value {k.shape[1]}: H must be H_kv * kv_head_repeat")
        mask = check_key_mask(key_mask, joint_key_mask, q, self.mesh.world_size, joint)
        scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
        self._check_uniform(q, joint, scale, k.shape[1], mask)
        k, v, joint, kwargs = call_args(self._impl.spec, q, k, v, joint, mask)
        self.calls += 1
        attends = attend_calls()  # process-wide: other contexts' calls do not count here
        try:
            return self._impl(q, k, v, joint, scale, **kwargs)
        except (CommTimeout, PeerFailure) as exc:
            self.failed = True
            raise type(exc)(f"{self.strategy}: {exc}") from exc
        except BaseException:
            self.failed = True
            raise
        finally:
            self._attends += attend_calls() - attends

    def _check_uniform(self, q: torch.Tensor, joint: Joint | None, scale: float,
                       heads_kv: int | None = None, key_mask: KeyMask | None = None) -> None:
        """Collective on the first call with each input signature (one all-gather of 10
        numbers): every rank must pass the same B, H, S_local, D, dtype, joint tokens, scale,
        K/V heads and kind of key mask.
        A mismatch is an ``InputError`` naming the field and each rank's value, instead of a
        transport abort (gloo kills the process on a message-size mismatch) or a wrong result.
        A rank that alone changes its shapes waits here for at most ``timeout_s`` (``CommTimeout``)."""
        sig = _signature(q, joint, scale, heads_kv, key_mask)
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
        # the all-gather spans the world (every SP group checks at once); compare my SP group's
        members = self.members if self.members is not None else range(len(rows))
        rows = [tuple(rows[m].tolist()) for m in members]
        bad = [i for i in range(len(sig)) if len({r[i] for r in rows}) > 1]
        if bad:
            diff = "; ".join(f"{_SIGNATURE[i]}: " + ", ".join(f"rank {r}={_show(i, row[i])}"
                                                              for r, row in enumerate(rows))
                             for i in bad)
            raise InputError(
                f"{self.strategy}: inputs differ across the {len(rows)} ranks of the SP group "
                f"({diff}). Every rank must pass query [B, H, S_local, D] and key/value "
                f"[B, H_kv, S_local, D] with the same B, H, H_kv, D, dtype and the same S_local = "
                f"L / {len(rows)} (pad the sequence to a multiple of the SP degree), and the same "
                "joint tensors, scale and key masks.")
        self._checked.add(sig)

    def stats(self) -> dict:
        """Per-rank counters since init or the last ``reset_stats``: calls, bytes to this and
        other machines, host operations (``transfers``: puts, gets and sends to other ranks;
        ``grouped_exchanges``: two-sided batches posted; ``barriers``: one-sided barriers and
        syncs; ``attend_calls``: local attention calls, one kernel launch each with the
        Triton kernel), symmetric heap bytes, the calls an integration handed elsewhere, and
        the strategy's execution plans (``plans_compiled`` since init: one per new input
        signature; ``plans_cached``; ``plan_steps``: steps of the cached plans)."""
        total = lambda name: sum(getattr(c.counter, name) for c in self._comms)  # noqa: E731
        heap = sum(c.symmetric_heap_bytes() for c in self._comms if isinstance(c, OneSided))
        return {"strategy": self.strategy, "mesh": self.mesh.describe(), "calls": self.calls,
                "intra_node_bytes": total("intra_node_bytes"),
                "inter_node_bytes": total("inter_node_bytes"),
                "transfers": total("messages"), "grouped_exchanges": total("grouped_calls"),
                "barriers": total("barriers"), "attend_calls": self._attends,
                "symmetric_heap_bytes": heap, "fallbacks": dict(self.fallbacks),
                **plan_stats(self._impl)}

    def reset_stats(self) -> None:
        self.calls = 0
        self._attends = 0
        self.fallbacks.clear()
        for c in self._comms:
            c.counter.reset()

    def close(self) -> None:
        """Release communicators and symmetric buffers (idempotent)."""
        if self.closed:
            return
        self.closed = True
        self._impl.close(self.failed)
        for c in self._comms:
            if isinstance(c, OneSided) and self.failed:
                # a mid-layer peer would pair its own barrier with this one and go on with
                # missing data: close without it, peers then see a closed rank (PeerFailure);
                # the communicator skips its collective teardown too
                c.failed = True
                logger.warning(f"rank {self.rank}: closing {self.strategy} after a failed call, "
                               "without the final barrier")
            elif isinstance(c, OneSided):
                # peers may still be reading my buffers: wait for them (bounded by the timeout)
                try:
                    c.barrier_all(what="close")
                except (CommTimeout, PeerFailure) as exc:
                    logger.warning(f"rank {self.rank}: closing after a failed final barrier: {exc}")
            c.close()

    def __enter__(self) -> "SequenceParallelContext":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None:
            self.failed = True
        self.close()


def init_sequence_parallel(strategy: str = "swiftfusion", num_heads: int | None = None,
                           topology: str | Topology | None = None, *,
                           ulysses_degree: int | None = None, ring_degree: int | None = None,
                           timeout_s: float | None = None, comm: str = "auto",
                           options: dict | None = None,
                           ranks: list[int] | tuple[int, ...] | None = None
                           ) -> SequenceParallelContext:
    """Bind ``strategy`` to an SP group: the default process group, or the group ``ranks``
    (call after ``dist.init_process_group``; collective over the default group).

    ``num_heads``: the model's attention heads (fixes the Ulysses degree ``gcd(N*M, H)``
    unless ``ulysses_degree``/``ring_degree`` are given). ``topology``: ``"NxM"`` override of
    the detected machines x GPUs. ``comm``: one-sided backend for ``swiftfusion``
    (``"nvshmem"``, ``"auto"``: NVSHMEM on GPUs, or another registered backend, e.g. the CPU
    emulation's ``"shm"``). ``options``: passed to the strategy's builder (``auto``:
    ``usp_ulysses``, the Ulysses degree of xFuser's existing groups); ``pad_heads`` (default
    True): a strategy that needs the Torus schedule, on a default mesh that does not fit the
    machines (``N`` does not divide ``gcd(N*M, H)``) and without given degrees, runs on ``H'``
    zero-padded heads (``mesh.torus_padding``, ``strategies/padded.py``; logged once with its
    ``H'/H`` cost); False: its fallback runs instead. The context's ``num_heads`` stays ``H``,
    its ``mesh`` is the one that runs (the padded one). ``fp8_comms`` (default False): tas,
    torus and swiftfusion send what crosses machines (Q, K, V in, O out) as float8 e4m3 with
    one fp32 scale per slot and tensor, about half the inter-machine bytes. ``cuda_graphs``
    (default ``$SWIFTFUSION_CUDA_GRAPHS``, else True on CUDA): tas, torus and swiftfusion
    replay each input signature's execution plan as a CUDA graph from its second call
    (``strategies/planned.py``). ``launches`` (torus, swiftfusion; default ``"stage"`` on
    CUDA, ``"ring"`` on CPU): one attention launch per Torus stage and query block over the
    gathered ring group's K/V, or one per ring step (``strategies/torus.py``).
    ``kv_pieces`` (torus, swiftfusion; default 1): the last Pull-KV stage's K/V block in that
    many pieces, each attended as it arrives (``strategies/torus.py``; ``fp8_comms`` refuses
    more than one); under ``auto`` unset: the P of 1, 2, 4 the cost model predicts fastest.

    Every call of tas, torus and swiftfusion runs an execution plan: the first call with an input
    signature compiles the layer (checks, buffers, chunk tables, resolved transfers), later
    calls only issue its launches and transfers (``plan.py``; ``stats()`` counts the plans).

    ``ranks``: global ranks of this rank's SP group, in SP-rank order (default: every rank).
    Every rank of the default group calls with its own group's ranks; the groups must be
    disjoint, of one size, and cover the world (e.g. xFuser's CFG parallelism: ``[0, W/2)`` and
    ``[W/2, W)``). ``topology`` then describes the whole default group; the context's
    ``topology`` is its SP group's machines x GPUs, and its ``mesh`` and ``rank`` are over SP
    ranks. With several SP groups, a strategy's first call with new input shapes is collective
    over the world (symmetric buffers span every rank): the SP groups must make the same
    attention calls in the same order, as CFG halves do.
    """
    spec = get(strategy)
    if num_heads is None:
        raise ValueError("num_heads is required: the Ulysses degree is gcd(world size, num_heads)")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("torch.distributed is not initialised; call dist.init_process_group "
                           "(torchrun) before init_sequence_parallel")
    from .comm import prepare_two_sided
    from .groups import check_sp_groups
    from .log import log_once
    from .mesh import torus_mesh
    from .strategies.padded import build_padded, padding_message
    from .topology import TopologyError, subset_topology

    rank, world = dist.get_rank(), dist.get_world_size()
    check_device()
    world_topo = topo = detect_topology(world, topology)
    timeout_s = float(timeout_s) if timeout_s is not None else default_timeout_s()
    members = sp_groups = None  # None: the SP group is the default group, SP rank = rank
    if ranks is not None:
        every: list = [None] * world
        dist.all_gather_object(every, tuple(int(x) for x in ranks))
        sp_groups = check_sp_groups(dict.fromkeys(every), world)  # the same on every rank
        stray = [x for x in range(world) if x not in every[x]]
        if stray:
            raise ValueError(f"ranks {stray} are not in the SP group they passed "
                             f"({[list(every[x]) for x in stray]}): pass ranks= with your own group")
        members = every[rank]
        if sp_groups == (tuple(range(world)),):
            members = sp_groups = None
    if members is not None:
        tops = {subset_topology(world_topo, g) for g in sp_groups}
        if len(tops) > 1:
            raise TopologyError(f"the SP groups span machines differently on topology {world_topo} "
                                f"({', '.join(map(str, tops))}); every SP group needs the same "
                                "machines x GPUs")
        topo = subset_topology(world_topo, members)
    sp_rank = rank if members is None else members.index(rank)
    pad = (options or {}).get("pad_heads", True)
    # heads: what the strategy runs on, more than num_heads when zero-padded
    mesh, heads = (torus_mesh(topo, num_heads, spec.placement, ulysses_degree, ring_degree, pad)
                   if spec.needs_torus else
                   (choose_mesh(topo, num_heads, spec.placement, ulysses_degree, ring_degree),
                    num_heads))
    if heads != num_heads and sp_rank == 0:
        log_once(logger, f"pad-heads-{spec.name}-{num_heads}-{topo}",
                 padding_message(num_heads, heads, topo, spec.name))
    elif (not pad and spec.needs_torus and not mesh.torus_ready and sp_rank == 0
          and ulysses_degree is None and ring_degree is None):
        log_once(logger, f"no-pad-heads-{spec.name}-{num_heads}-{topo}",
                 f"{spec.name}: options pad_heads=False: {num_heads} heads are not padded for the "
                 f"Torus schedule on {topo}; its fallback runs")
    node_of = [world_topo.node_of(x) for x in range(world)]  # machine of every global rank
    if sp_groups is not None and len(sp_groups) > 1:
        prepare_two_sided()  # collective over the world: now, not in a first attention call
    made: dict[str, object] = {}

    def once(kind: str, make):
        """One communicator of each kind per context (auto's children share it)."""
        if kind not in made:
            made[kind] = make()
        return made[kind]

    args = BuildArgs(
        mesh=mesh, groups=build_groups(mesh, sp_rank, members=members, sp_groups=sp_groups),
        rank=sp_rank, num_heads=num_heads, timeout_s=timeout_s,
        one_sided=lambda: once("one", lambda: make_one_sided(
            comm, rank=rank, world_size=world, node_of=node_of, timeout_s=timeout_s,
            members=members, sp_groups=sp_groups)),
        two_sided=lambda: once("two", lambda: make_two_sided(
            rank=rank, world_size=world, node_of=node_of, timeout_s=timeout_s, members=members)),
        options={"comm": comm, **(options or {})})
    runs = spec.resolve(mesh)
    if runs.one_sided:
        from .hwtopo import last_detection, p2p_refusal
        why = p2p_refusal(last_detection(), runs.name)
        if why:
            raise ValueError(why)
    impl = runs.build(args) if heads == num_heads else build_padded(runs, args, heads)
    ctx = SequenceParallelContext(impl.spec.name, topo, mesh, sp_rank, num_heads, timeout_s, impl,
                                  members=tuple(members) if members is not None else None)
    group = "" if members is None else f", SP group {list(members)} (SP rank {sp_rank})"
    logger.debug(f"rank {rank}: strategy {ctx.strategy}, topology {topo}{group}, "
                 f"mesh {mesh.describe()}")
    return ctx
