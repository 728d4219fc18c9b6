"""The strategy registry: one ``StrategySpec`` per sequence-parallel strategy.

A spec knows its name, its mesh placement, what the cost and byte models need to know of it,
where it cannot run and what runs instead (logged once), and how to build a ``Strategy`` from
a ``BuildArgs`` (mesh, groups, rank, timeouts, a one-sided communicator factory). Context,
cost model, ``plan``, the integrations and the tools ask the spec; nothing outside this module
and the command-line choices compares strategy names.

Core specs (``tas``, ``torus``, ``swiftfusion``, ``auto``) register when ``strategies`` is
imported. Others come from the entry-point group ``xfuser_swiftfusion.strategies`` (the xFuser
integration provides ``usp`` there), loaded on first lookup: the core never imports them.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, Callable, Protocol

import torch

from ..groups import SPGroups
from ..log import get_logger, log_once
from ..mesh import Mesh
from .layout import InputError, Joint, KeyMask

logger = get_logger(__name__)

ENTRY_POINT_GROUP = "xfuser_swiftfusion.strategies"


class Strategy(Protocol):
    """One sequence-parallel attention bound to its groups (the USP contract):
    ``[B, H, S_local, D]`` in, ``[B, H, Tj + S_local, D]`` out (text rows as ``joint`` says).
    A spec with ``native`` features also takes K/V ``[B, H_kv, S_local, D]`` (``"gqa"``) and
    a ``key_mask=`` keyword (``"key_mask"``); ``call_args`` adapts calls to the others."""

    spec: "StrategySpec"          # what runs (after any resolution)
    comms: list                   # communicators it owns (counters, heap, close)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 joint: Joint | None, scale: float) -> torch.Tensor: ...

    def close(self, failed: bool) -> None:
        """Release what it owns besides ``comms`` (idempotent)."""


@dataclass
class BuildArgs:
    """What a spec builds a strategy from (every rank passes the same, but ``rank``)."""

    mesh: Mesh
    groups: SPGroups
    rank: int
    num_heads: int
    timeout_s: float
    one_sided: Callable[[], Any]          # collective factory of the one-sided communicator
    two_sided: Callable[[], Any]          # collective factory of the two-sided communicator
    # spec-specific: auto's ``usp_ulysses``/``external``; ``fp8_comms`` (tas, torus,
    # swiftfusion, auto's children): inter-machine Q, K, V, O as FP8 with scales (``fp8.py``)
    options: dict = field(default_factory=dict)


@dataclass(frozen=True)
class StrategySpec:
    """A strategy's description and builder.

    ``placement``: mesh placement (``"usp"``: Ulysses inside machines, ``"tas"``: across).
    ``program``: ``(mesh, rank, shape) -> ops`` (``ops.py``), the calls one rank makes in one
    layer, expanded from the step list the strategy executes: what the cost model's timeline
    runs (None: not modelled, ``auto``). ``ring``: K/V ring form for the byte model
    (``"pass"``/``"pull"``).
    ``one_sided``: moves data by put/get. ``needs_torus``: runs only where every ring group is
    inside one machine; elsewhere ``fallback`` runs. ``baseline``: what ``auto`` must never be
    predicted slower than. ``external_groups``: runs on groups built outside this package
    (xFuser's), whose degrees are fixed once built; ``built_ulysses``: the Ulysses degree of
    those groups where they already exist in this process, else None (the only degree the spec
    can then run). ``order``: tie-break rank and listing order.
    ``native``: call features it runs itself (``"gqa"``: K/V with fewer heads, ``"key_mask"``:
    a ``KeyMask`` keyword); ``call_args`` adapts a call to the others. ``launch_modes``: the
    values of its ``launches`` option, which its ``program`` takes as a keyword (the first:
    the default of its program). ``program_options``: the other options its ``program`` takes
    as keywords (``torus``, ``swiftfusion``: ``kv_pieces``).
    """

    name: str
    placement: str
    summary: str
    build: Callable[[BuildArgs], Strategy] = field(repr=False, compare=False)
    program: Callable[[Mesh, int, Any], list] | None = field(default=None, repr=False, compare=False)
    ring: str = "pass"
    one_sided: bool = False
    needs_torus: bool = False
    fallback: str | None = None
    baseline: bool = False
    external_groups: bool = False
    built_ulysses: Callable[[], int | None] | None = field(default=None, repr=False, compare=False)
    order: int = 100
    native: tuple[str, ...] = ()
    launch_modes: tuple[str, ...] = ()
    program_options: tuple[str, ...] = ()

    def runs_on(self, mesh: Mesh) -> bool:
        return mesh.torus_ready or not self.needs_torus

    def resolve(self, mesh: Mesh, *, log: bool = True) -> "StrategySpec":
        """The spec that runs on ``mesh``: this one, or its fallback (logged once)."""
        spec = self
        while not spec.runs_on(mesh):
            nxt = get(spec.fallback)
            if log:
                log_once(logger, f"fallback-{spec.name}-{mesh}",
                         f"{spec.name}: the Torus schedule needs every ring group inside one machine "
                         f"(ring degree {mesh.ring} must divide {mesh.topology.gpus_per_node} GPUs "
                         f"per machine; mesh {mesh.describe()} on {mesh.topology}); running "
                         f"{nxt.name!r} instead")
            spec = nxt
        return spec


NATIVE = ("gqa", "key_mask")  # what the core strategies run natively


def call_args(spec: StrategySpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              joint: Joint | None, key_mask: KeyMask | None
              ) -> tuple[torch.Tensor, torch.Tensor, Joint | None, dict]:
    """``(k, v, joint, kwargs)`` to call a strategy of ``spec`` with: K/V (and text K/V)
    repeated to the query heads where it has no native GQA (logged once); ``kwargs`` holds
    the key mask, which a strategy without ``"key_mask"`` cannot honour (``InputError``)."""
    H, Hkv = q.shape[1], k.shape[1]
    if Hkv != H and "gqa" not in spec.native:
        log_once(logger, f"gqa-repeat-{spec.name}-{H}-{Hkv}",
                 f"{spec.name}: no native grouped-query attention; K/V repeated from {Hkv} to {H} "
                 f"heads ({H // Hkv}x the K/V bytes)")
        rep = lambda x: x.repeat_interleave(H // Hkv, dim=1)  # noqa: E731  [B, H_kv, L, D] -> [B, H, L, D]
        k, v = rep(k), rep(v)
        if joint is not None:
            joint = Joint(joint.q, rep(joint.k), rep(joint.v), joint.strategy)
    if key_mask is None:
        return k, v, joint, {}
    if "key_mask" not in spec.native:
        raise InputError(f"strategy {spec.name!r} cannot apply a key mask; use one of the core "
                         "strategies (tas, torus, swiftfusion, auto)")
    return k, v, joint, {"key_mask": key_mask}


_REGISTRY: dict[str, StrategySpec] = {}
_loaded_entry_points = False


def register(spec: StrategySpec) -> StrategySpec:
    """Add ``spec`` (a name registers once; the same spec again is a no-op)."""
    old = _REGISTRY.get(spec.name)
    if old is not None and old is not spec:
        raise ValueError(f"strategy {spec.name!r} is already registered")
    _REGISTRY[spec.name] = spec
    return spec


def _load_entry_points() -> None:
    global _loaded_entry_points
    if _loaded_entry_points:
        return
    _loaded_entry_points = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in _REGISTRY:
            try:
                register(ep.load())
            except Exception as exc:  # noqa: BLE001  (a broken plugin must not break the core)
                log_once(logger, f"entry-point-{ep.name}",
                         f"strategy {ep.name!r} from {ep.value} could not be loaded "
                         f"({type(exc).__name__}: {exc})", logging.WARNING)


def get(name: str) -> StrategySpec:
    """The spec of ``name``; ``ValueError`` naming the choices if there is none."""
    if name not in _REGISTRY:
        _load_entry_points()
    if name not in _REGISTRY:
        raise ValueError(f"unknown strategy {name!r}; choose one of {', '.join(names())}")
    return _REGISTRY[name]


def specs() -> list[StrategySpec]:
    """Every registered spec, in ``order``."""
    _load_entry_points()
    return sorted(_REGISTRY.values(), key=lambda s: (s.order, s.name))


def names() -> tuple[str, ...]:
    return tuple(s.name for s in specs())


def modelled() -> list[StrategySpec]:
    """Specs the cost model predicts (every concrete strategy; not ``auto``)."""
    return [s for s in specs() if s.program is not None]


__all__ = ["BuildArgs", "NATIVE", "call_args", "ENTRY_POINT_GROUP", "Strategy", "StrategySpec", "get", "modelled",
           "names", "register", "specs"]
