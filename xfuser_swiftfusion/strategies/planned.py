"""A strategy's layer as execution plans (``plan.py``), one per input signature, and as CUDA
graphs of those plans.

``PlanCache(layer)`` is the strategy's callable under the USP contract. The first call with an
input signature (shapes, dtypes, device, text tokens and their strategy, scale, kind of key
mask) allocates the plan's input buffers, compiles ``layer`` on them, and runs the plan; later
calls copy their inputs into those buffers and run it. At most ``size`` plans are kept (least
recently used first out); ``stats()`` counts them. Inside another layer's compile the call is
inlined (``layer`` records into the enclosing plan).

CUDA graphs (option ``cuda_graphs``, else ``$SWIFTFUSION_CUDA_GRAPHS`` = on/off, else on for
CUDA tensors): the second call of a signature captures the plan's steps in a CUDA graph (the
first, eager run was the warm-up: allocations, NVSHMEM rendezvous and teams, triton compiles,
NCCL communicators) and every call from then on copies its inputs, replays the graph and
evaluates the output. Every rank captures at the same call, and the captured work is the one
the eager run issues, so ranks that replay and ranks that run eagerly still meet. While
capturing, the communicators watch nothing (``Communicator.capturing``: a captured event or
NCCL work cannot be queried) and note what they issue; after each replay they watch one event
recorded behind it (``Communicator.watch``), whose timeout names this rank, the peers and the
stages of the captured transfers and barriers and the layer; a replay first raises what a
watchdog found after an earlier one (``Communicator.check``). Replays add to the counters what
the capture issued (the communicators' byte counters, their ``replay_counts`` and
``attend_calls``). Where capture fails (a call that synchronizes with the host, an operation
CUDA cannot capture) the plan runs eagerly from then on and the reason is logged once; where a
communicator says its work cannot be captured (``capture_refused``: NVSHMEM's limited
multi-process mode) no capture is tried and that is logged once. Capture runs on a stream of
its own inside an outer ``torch.cuda.stream`` context of ours: ``torch.cuda.graph.__exit__``
raises in ``capture_end`` before leaving its own stream context, and the outer one still puts
the caller back on its stream. Capture uses ``capture_error_mode="thread_local"``, so the
watchdog threads' queries of events recorded outside the capture stay legal during it.

Every strategy builds its cache with ``PlanCache.for_strategy(strategy, options)``: the
strategy's ``layer``, its communicators (``comms``) and its ``cuda_graphs`` option; the
constructor takes ``comms`` and ``graphs`` as required keywords, so no cache is built
without them.
"""
from __future__ import annotations

import contextlib
import logging
import os
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import plan
from ..kernels import dispatch
from ..log import get_logger, log_once
from .layout import Joint, KeyMask

logger = get_logger(__name__)

DEFAULT_PLANS = 8
GRAPHS_OPTION = "cuda_graphs"
GRAPHS_ENV = "SWIFTFUSION_CUDA_GRAPHS"
_ON, _OFF = ("1", "on", "true", "yes"), ("0", "off", "false", "no")


def graphs_requested(options: dict) -> bool | None:
    """Option ``cuda_graphs`` (a bool), else ``$SWIFTFUSION_CUDA_GRAPHS`` (on/off), else None
    (the default: on for CUDA tensors). ``ValueError`` naming the accepted values otherwise."""
    value = options.get(GRAPHS_OPTION)
    if value is not None:
        if not isinstance(value, bool):
            raise TypeError(f"option {GRAPHS_OPTION!r} must be True or False, got {value!r}")
        return value
    env = os.environ.get(GRAPHS_ENV, "").strip().lower()
    if not env:
        return None
    if env not in (*_ON, *_OFF):
        raise ValueError(f"${GRAPHS_ENV}={env!r}: use on or off")
    return env in _ON

Layer = Callable[..., torch.Tensor]  # (q, k, v, joint, scale, key_mask) -> out
_COUNTS = ("intra_node_bytes", "inter_node_bytes", "messages", "grouped_calls", "barriers")


def signature(q: torch.Tensor, k: torch.Tensor, joint: Joint | None, scale: float,
              key_mask: KeyMask | None) -> tuple:
    """What a plan is compiled for: the shapes, dtype and device of the inputs, the text tokens
    and their strategy, the scale and which key masks are given."""
    return (tuple(q.shape), tuple(k.shape), q.dtype, q.device, scale,
            None if joint is None else (tuple(joint.q.shape), tuple(joint.k.shape), joint.strategy),
            None if key_mask is None else (key_mask.tokens is not None, key_mask.text is not None))


def _empty(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None else torch.empty(x.shape, dtype=x.dtype, device=x.device)


@dataclass
class _Entry:
    """A compiled plan and its input buffers (``inputs[i]`` receives ``args[i]`` at each run);
    ``graph``: its CUDA graph once captured; ``capture``: capture at the next run after the
    first."""

    plan: plan.Plan
    inputs: list[torch.Tensor]
    capture: bool = False
    graph: object = None
    counts: list[int] | None = None  # what one replay adds to the counters (not run by Python)
    runs: int = 0
    replays: list[str] | None = None  # per communicator: what a replay of its captured work does


class PlanCache:
    """``layer`` (``(q, k, v, joint, scale, key_mask)``) run as plans (module docstring).
    ``comms``: the communicators the layer uses (watched around CUDA graphs; [] for a layer
    without any); ``graphs``: ``graphs_requested``'s answer (None: on for CUDA tensors);
    ``name``: for messages. Strategies build theirs with ``for_strategy``."""

    def __init__(self, layer: Layer, size: int = DEFAULT_PLANS, *, comms: list,
                 graphs: bool | None, name: str = "layer") -> None:
        self.layer, self.size, self.graphs, self.name = layer, size, graphs, name
        self.comms = list({id(c): c for c in comms}.values())
        # the byte counters ctx.stats() reads (communicators may share one)
        self._counter_objects = list({id(c.counter): c.counter for c in self.comms}.values())
        self._plans: OrderedDict[tuple, _Entry] = OrderedDict()
        self.compiled = 0
        self.captured = 0
        self._streams: dict[torch.device, object] = {}

    @classmethod
    def for_strategy(cls, strategy: object, options: dict | None, size: int = DEFAULT_PLANS) -> "PlanCache":
        """The plan cache of ``strategy``: its ``layer``, its communicators (``strategy.comms``,
        a wrapper's those of the strategy it wraps), its ``cuda_graphs`` option
        (``graphs_requested(options)``) and its spec's name."""
        spec = getattr(strategy, "spec", None)
        return cls(strategy.layer, size, comms=list(strategy.comms),
                   graphs=graphs_requested(options or {}),
                   name=spec.name if spec is not None else type(strategy).__name__)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, joint: Joint | None,
                 scale: float, key_mask: KeyMask | None = None) -> torch.Tensor:
        if plan.compiling():
            return self.layer(q, k, v, joint, scale, key_mask)
        key = signature(q, k, joint, scale, key_mask)
        entry = self._plans.get(key)
        if entry is None:
            entry = self._compile(key, q, k, v, joint, scale, key_mask)
        else:
            self._plans.move_to_end(key)
        return self._run(entry, _args(q, k, v, joint, key_mask))

    def _run(self, entry: _Entry, args: list[torch.Tensor]) -> torch.Tensor:
        for buf, x in zip(entry.inputs, args):
            buf.copy_(x)
        entry.runs += 1
        if entry.capture and entry.runs > 1:  # the first run was the warm-up
            entry.capture = False
            before = self._counters()
            entry.graph = self._capture(entry)  # counts one run's transfers, as the replay below
            if entry.graph is not None:
                self.captured += 1
                entry.counts = [b - a for a, b in zip(before, self._counters())]
        elif entry.graph is not None:
            for c in self.comms:  # what a watchdog found after an earlier replay (no Python
                c.check()         # of the communicators runs in a replay to raise it)
            self._add_counts(entry.counts)
        if entry.graph is None:
            return entry.plan.run()
        entry.graph.replay()
        event = torch.cuda.Event()
        event.record()
        for c, doing in zip(self.comms, entry.replays):
            c.watch(event, f"{self.name}: CUDA graph replay", doing)
        return entry.plan.output()

    def _counters(self) -> list[int]:
        """Every counter a replay advances: the communicators' byte counters (what
        ``ctx.stats()`` reads), their own ``replay_counts`` (e.g. a stand-in's copies) and
        ``attend_calls``."""
        return ([getattr(c, n) for c in self._counter_objects for n in _COUNTS]
                + [getattr(c, n) for c in self.comms for n in c.replay_counts]
                + [dispatch.attend_calls()])

    def _add_counts(self, counts: list[int]) -> None:
        it = iter(counts)
        for c in self._counter_objects:
            for n in _COUNTS:
                setattr(c, n, getattr(c, n) + next(it))
        for c in self.comms:
            for n in c.replay_counts:
                setattr(c, n, getattr(c, n) + next(it))
        dispatch.add_attend_calls(next(it))

    def _capture_stream(self, device: torch.device):
        """This cache's capture stream on ``device`` (a capture that failed leaves torch's
        allocator thinking its stream still captures on some versions: never the caller's)."""
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        return stream

    def _capture(self, entry: _Entry):
        """The plan's steps captured in a CUDA graph (nothing runs), or None (logged once).
        Sets ``entry.replays``: what a replay does, per communicator."""
        inside: list[BaseException] = []
        graph = torch.cuda.CUDAGraph()
        caller = torch.cuda.current_stream()
        side = self._capture_stream(caller.device)
        issued: list[list] = []
        try:
            side.wait_stream(caller)  # the inputs copied on the caller's stream
            # the outer context: torch.cuda.graph's own is not left when capture_end raises
            with torch.cuda.stream(side), contextlib.ExitStack() as stack:
                for c in self.comms:
                    issued.append(stack.enter_context(c.capturing()))
                stack.enter_context(torch.cuda.graph(graph, stream=side,
                                                     capture_error_mode="thread_local"))
                try:
                    entry.plan.run_steps()
                except BaseException as exc:
                    inside.append(exc)
                    raise
        except Exception as exc:  # noqa: BLE001  (what cannot be captured runs eagerly)
            torch.cuda.synchronize()
            first = inside[0] if inside else exc
            log_once(logger, f"graph-failed-{self.name}-{type(first).__name__}",
                     f"{self.name}: its plan could not be captured in a CUDA graph "
                     f"({type(first).__name__}: {str(first).strip().splitlines()[0] if str(first).strip() else ''}); "
                     "it runs eagerly (cuda_graphs=False skips the attempt)", logging.WARNING)
            return None
        entry.replays = [replay_doing(self.name, notes or [], c.rank) for c, notes in zip(self.comms, issued)]
        return graph

    def _compile(self, key: tuple, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 joint: Joint | None, scale: float, key_mask: KeyMask | None) -> _Entry:
        # the plan's inputs: buffers of the same shapes the layer is compiled on
        sq, sk, sv = _empty(q), _empty(k), _empty(v)
        sjoint = None if joint is None else Joint(_empty(joint.q), _empty(joint.k), _empty(joint.v),
                                                  joint.strategy)
        smask = None if key_mask is None else KeyMask(_empty(key_mask.tokens), key_mask.S,
                                                      _empty(key_mask.text))
        compiled = plan.compile(self.layer, sq, sk, sv, sjoint, scale, smask)
        entry = _Entry(compiled, _args(sq, sk, sv, sjoint, smask),
                       capture=self._graphs_on(q.device) and compiled.output is not None)
        self._plans[key] = entry
        self.compiled += 1
        while len(self._plans) > self.size:
            self._plans.popitem(last=False)
        return entry

    def _graphs_on(self, device: torch.device) -> bool:
        if graph_device(device):
            if self.graphs is False:
                return False
            refused = next((c.capture_refused for c in self.comms if c.capture_refused), None)
            if refused:
                log_once(logger, f"graphs-refused-{self.name}", f"{self.name}: no CUDA graphs: "
                         f"{refused}; the plans run eagerly", logging.WARNING)
                return False
            return True
        if self.graphs:
            log_once(logger, f"graphs-cpu-{self.name}", f"{self.name}: CUDA graphs need CUDA "
                     f"tensors; the plans run eagerly on {device.type}", logging.INFO)
        return False

    def stats(self) -> dict[str, int]:
        """``plans_compiled`` since init, ``plans_cached`` now, ``plan_steps`` of the cached
        plans, ``graphs_captured`` since init."""
        return {"plans_compiled": self.compiled, "plans_cached": len(self._plans),
                "plan_steps": sum(len(e.plan) for e in self._plans.values()),
                "graphs_captured": self.captured}


def graph_device(device: torch.device) -> bool:
    """Whether plans on ``device`` may be captured in CUDA graphs (CUDA devices)."""
    return device.type == "cuda"


def replay_doing(name: str, notes: list[tuple[tuple[int, ...] | None, str, str]], rank: int) -> str:
    """What a replay of ``name``'s captured work does, for a watchdog's message: the peers
    (besides ``rank``) and stages of the transfers and barriers a communicator noted while
    capturing (``notes``: ``(peers or None for all ranks, doing, stage)``)."""
    peers = sorted({p for ranks, _, _ in notes if ranks for p in ranks} - {rank})
    every = any(ranks is None for ranks, _, _ in notes)
    stages = list(dict.fromkeys(what for _, _, what in notes))
    shown = ", ".join(repr(s) for s in stages[:6]) + (f" and {len(stages) - 6} more" if len(stages) > 6 else "")
    who = " and ".join(([f"peers {peers}"] if peers else []) + (["a barrier over all ranks"] if every else []))
    return (f"a CUDA graph replay of {name}'s {len(notes)} transfers and barriers "
            f"(with {who or 'no peer'}; stages {shown or 'none'})")


def _args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, joint: Joint | None,
          key_mask: KeyMask | None) -> list[torch.Tensor]:
    """The tensors of a call, in the order of a plan's input buffers."""
    out = [q, k, v]
    if joint is not None:
        out += [joint.q, joint.k, joint.v]
    if key_mask is not None:
        out += [x for x in (key_mask.tokens, key_mask.text) if x is not None]
    return out


def plan_stats(strategy: object) -> dict[str, int]:
    """The plan counters of ``strategy`` and the strategies it holds (``plans``: its
    ``PlanCache``; ``plan_children``: strategies it delegates to)."""
    total = {"plans_compiled": 0, "plans_cached": 0, "plan_steps": 0, "graphs_captured": 0}
    cache = getattr(strategy, "plans", None)
    if isinstance(cache, PlanCache):
        for name, n in cache.stats().items():
            total[name] += n
    for child in getattr(strategy, "plan_children", lambda: [])():
        for name, n in plan_stats(child).items():
            total[name] += n
    return total


__all__ = ["DEFAULT_PLANS", "GRAPHS_ENV", "GRAPHS_OPTION", "PlanCache", "graph_device",
           "graphs_requested", "plan_stats", "replay_doing", "signature"]
