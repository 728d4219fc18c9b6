"""``auto``: the strategy and Ulysses degree the cost model predicts fastest, per input shape.

The sequence length is known only at the first attention call, so the choice is made lazily,
per input signature ``(B, S_local, D, dtype, text tokens)``, by ``cost_model.recommend`` — a pure
function of inputs every rank shares (topology, heads, shape, hardware profile), so all ranks
pick the same strategy without communicating. The chosen child strategy is built at that first
call (collective on every rank, as ``init_sequence_parallel`` is) and cached; children are
shared between signatures that pick the same (strategy, degree).

Hardware profile: ``$SWIFTFUSION_HARDWARE``, a built-in profile's name or a profile file that
``swiftfusion calibrate`` measured on this cluster; unset: ``cpu-emulated`` on CPU tensors,
on CUDA the one-box profile of the GPUs where one host was cut into islands from NVML
(``l40s-2s``...), else ``p4de`` (datasheet links, this code's measured GPU costs). Where NVML
reports GPU peer-to-peer off, the one-sided strategy is no candidate. The model never predicts
the choice slower than default ``usp``; where it picks ``usp``, rank 0 says why once per
profile and topology (``cost_model.why_baseline``). The pick carries its K/V pieces
(``kv_pieces`` P, ``strategies/torus.py``): the model prices torus and swiftfusion at P in
{1, 2, 4} too, unless the context's options pin P (``pinned_pieces``), and the child is built
with the P picked (``build_options``).

Competing levels (``hwtopo.Cut``): where detection found finer cuts of the ranks than the
topology the context was built on (NVLink pairs inside a socket's island; hosts x islands),
``auto`` compares its pick on every cut the profile has rates for (``levels``;
``cost_model.recommend_cut``: on a finer cut not the strategies on xFuser's groups) and
builds the child on the fastest cut's mesh; rank 0 logs the
comparison once per shape. Every finer cut refines the context's machines, so the
communicators built for those stay valid (a peer inside a finer machine is inside a
coarser one).
"""
from __future__ import annotations

import logging
import os
from dataclasses import replace

import torch

from ..cost_model import Workload, cut_options, get_profile, recommend_cut, why_baseline
from ..hardware import BOX_OF_GPU, HARDWARE_ENV, HardwareProfile
from ..hwtopo import HostIslands, last_detection
from ..log import get_logger, log_once
from ..mesh import Mesh, choose_mesh
from ..topology import Topology, TopologyError, subset_topology
from . import fp8
from .layout import Joint, KeyMask
from .padded import build_padded, padding_message
from .registry import NATIVE, BuildArgs, Strategy, StrategySpec, call_args, get, register, specs
from .torus import kv_pieces_option

logger = get_logger(__name__)

DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def hardware_profile_name(device: torch.device, detected: HostIslands | None = None) -> str:
    """``$SWIFTFUSION_HARDWARE`` (a profile name or file), else ``cpu-emulated`` for CPU
    tensors; for GPU ones the one-box profile of the detected GPUs (``detected``: one host cut
    into islands, ``hwtopo.py``; ``BOX_OF_GPU``) where there is one, else ``p4de``."""
    if os.environ.get(HARDWARE_ENV):
        return os.environ[HARDWARE_ENV]
    if device.type == "cpu":
        return "cpu-emulated"
    if detected is not None and detected.hosts == 1 and detected.islands_per_host > 1:
        box = {BOX_OF_GPU[k] for n in detected.gpu_names for k in BOX_OF_GPU if k in n}
        if len(box) == 1:
            return box.pop()
    return "p4de"


def hardware_profile(device: torch.device, topology: Topology,
                     detected: HostIslands | None = None) -> HardwareProfile:
    """The profile ``auto`` plans on (``hardware_profile_name``), without GPU peer-to-peer
    where the detection found it off (the one-sided strategy is then no candidate)."""
    profile = get_profile(hardware_profile_name(device, detected), topology)
    if detected is not None and detected.p2p_off and profile.p2p:
        profile = replace(profile, p2p=False)
    return profile


def pinned_pieces(options: dict) -> int | None:
    """The K/V pieces P the context's ``options`` pin: the user's ``kv_pieces`` (checked:
    ``torus.kv_pieces_option``); 1 under ``fp8_comms`` (pieces take whole-block wire slots);
    else None: the model chooses (``cost_model.piece_options``)."""
    if "kv_pieces" in options:
        return kv_pieces_option(options)
    return 1 if fp8.enabled(options) else None


def choose(topology: Topology, num_heads: int, q: torch.Tensor, usp_ulysses: int | None = None,
           external: bool = True, pad_heads: bool = True, detected: HostIslands | None = None,
           kv_pieces: int | None = None):
    """The model's pick for local queries ``q`` [B, H, S_local, D] (pure: same on every rank);
    text tokens are not modelled (they add the same replicated work to every strategy).
    ``usp_ulysses``: the Ulysses degree of xFuser's existing groups, the only one usp can use;
    ``external=False``: no strategy on xFuser's groups at all; ``detected``: the host's
    islands read from NVML at init (``hwtopo.last_detection``); ``kv_pieces``: the P the
    context pins (``pinned_pieces``), None: the model chooses it with the strategy."""
    best, cands, name, _ = choose_cut(topology, num_heads, q, usp_ulysses, external, pad_heads,
                                      detected, kv_pieces=kv_pieces)
    return best, cands, name


def choose_cut(topology: Topology, num_heads: int, q: torch.Tensor, usp_ulysses: int | None = None,
               external: bool = True, pad_heads: bool = True, detected: HostIslands | None = None,
               cuts: tuple[Topology, ...] = (), kv_pieces: int | None = None):
    """``choose`` over ``topology`` and its finer ``cuts`` (same ranks, fewer GPUs per
    machine): ``(pick, its cut's candidates, profile name, comparison)``; ``comparison``: None
    where no cut competes, else ``(index into (topology, *cuts) of the pick's cut, every
    compared cut's (topology, profile, pick), the cuts without rates in the profile)``."""
    B, _, S, D = q.shape
    dtype = DTYPES.get(q.dtype, "fp32")
    w = Workload(B, S * topology.world_size, num_heads, D, dtype)
    # the model depends on machines x GPUs only, not on which ranks an island holds
    plain = lambda t: Topology(t.nodes, t.gpus_per_node)  # noqa: E731
    profile = hardware_profile(q.device, plain(topology), detected)
    options, missing = cut_options(plain(topology), profile, [plain(c) for c in cuts])
    i, picks, cands = recommend_cut(options, w, usp_ulysses, external, pad_heads, kv_pieces)
    if not cuts:
        return picks[0], cands[0], profile.name, None
    at = [plain(topology), *map(plain, cuts)].index(options[i][0])
    return (picks[i], cands[i], profile.name,
            (at, [(t, p, b) for (t, p), b in zip(options, picks)], missing))


def finer_cuts(detected: HostIslands | None, topology: Topology,
               members: tuple[int, ...] | None = None) -> tuple[Topology, ...]:
    """The SP group's topologies of the detected finer cuts (``HostIslands.cuts`` after the
    first) that refine ``topology``'s machines; ``members``: the SP group's global ranks
    (None: every rank)."""
    out = []
    for cut in (detected.cuts[1:] if detected is not None else ()):
        try:
            world = Topology.from_machines(cut.machine_of)
            alt = world if members is None else subset_topology(world, members)
        except TopologyError:
            continue
        if alt.world_size == topology.world_size and all(
                topology.node_of(a) == topology.node_of(b)
                for m in alt.machines() for a in m for b in m):
            out.append(alt)
    return tuple(out)


def build_options(options: dict, picked: dict, spec: StrategySpec) -> dict:
    """The options a child of ``spec`` (the one that runs) is built with: the context's
    ``options`` and, over them, the pick's program options ``picked``
    (``Prediction.options``: the ``kv_pieces`` the model chose), less those ``spec`` does
    not take (``child_options``)."""
    return child_options({**options, **picked}, spec)


def child_options(options: dict, spec: StrategySpec) -> dict:
    """The options a child of ``spec`` (the one that runs, after its fallback) is built with:
    ``options`` less the schedule options it does not take (``StrategySpec.program_options``,
    e.g. ``kv_pieces`` on ``tas``, which has no Torus schedule), logged once."""
    schedule_options = dict.fromkeys(o for s in specs() for o in s.program_options)  # in order
    drop = [o for o in schedule_options if options.get(o, 1) != 1 and o not in spec.program_options]
    if not drop:
        return options
    log_once(logger, f"auto-drop-{spec.name}-{drop}",
             f"auto: {spec.name} takes no option {', '.join(drop)}; it runs without "
             f"({', '.join(f'{o}={options[o]!r}' for o in drop)} applies to the strategies that take it)")
    return {k: v for k, v in options.items() if k not in drop}


class AutoAttention:
    """Callable ``(q, k, v, joint, scale, key_mask=)`` under the USP contract (K/V may have
    fewer heads, ``layout``); delegates to the child
    strategy the model picks per input signature. Children are built (collectively) at the
    first call that picks them, from the parent's ``BuildArgs`` with their own mesh, and are
    shared between signatures that pick the same (strategy, Ulysses degree).
    ``args.options``: ``usp_ulysses``, the Ulysses degree of xFuser's existing groups, if any;
    ``external`` (default True), False to never pick a strategy on xFuser's groups; the
    children get every option (``fp8_comms`` included; the cost model prices compute-dtype
    transfers) but schedule options they do not take (``child_options``: ``kv_pieces`` reaches
    ``torus`` and ``swiftfusion`` only), with the pick's own ``kv_pieces`` over them: the model
    prices those at P in {1, 2, 4} (a given ``kv_pieces``, or ``fp8_comms``: P pinned,
    ``pinned_pieces``) and the child runs the P it picked (``picked``)."""

    detected: HostIslands | None = None  # the host's islands read from NVML at init, if any
    cuts: tuple[Topology, ...] = ()      # finer cuts that compete with the topology (docstring)

    def __init__(self, args: BuildArgs) -> None:
        self.args = args
        self.topology, self.num_heads, self.rank = args.mesh.topology, args.num_heads, args.rank
        self.comms: list = []
        self._by_signature: dict[tuple, Strategy] = {}
        self._children: dict[tuple, Strategy] = {}
        self.choices: dict[tuple, tuple[str, int]] = {}
        self.picked: dict[tuple, dict] = {}  # signature -> the pick's program options (kv_pieces)
        self.meshes: dict[tuple, Mesh] = {}  # (strategy, ulysses, heads[, cut], *picked) -> mesh
        self.detected = last_detection()
        # finer cuts of the ranks that compete with the context's topology (module docstring)
        self.cuts = finer_cuts(self.detected, self.topology, args.groups.members)
        self.topologies: dict[tuple, Topology] = {}  # signature -> its cut, where cuts compete

    def _external_ulysses(self) -> int | None:
        """The only Ulysses degree a strategy on external groups can run now: the option
        ``usp_ulysses``, else the degree of such groups that already exist in this process (xFuser's
        state, built by xFuser, another context or an earlier child), else None (any)."""
        given = self.args.options.get("usp_ulysses")
        if given is not None:
            return given
        built = (s.built_ulysses() for s in specs() if s.external_groups and s.built_ulysses)
        return next((d for d in built if d is not None), None)

    def _child(self, name: str, ulysses: int, heads: int, topology: Topology | None = None,
               picked: dict | None = None) -> Strategy:
        """The child ``name`` at ``ulysses`` on ``heads`` (> H: zero-padded) on ``topology``
        (a finer cut, or None), built with the pick's program options ``picked``
        (``build_options``)."""
        picked = picked or {}
        cut = topology if topology is not None and topology != self.topology else None
        key = (name, ulysses, heads) if cut is None else (name, ulysses, heads, str(cut), cut.order)
        key += tuple(sorted(picked.items()))
        topology = cut or self.topology
        if key not in self._children:
            spec = get(name)
            if heads == self.num_heads:
                mesh = choose_mesh(topology, self.num_heads, spec.placement, ulysses)
                runs = spec.resolve(mesh)
                child = runs.build(replace(self.args, mesh=mesh, groups=self.args.groups.for_mesh(mesh),
                                           options=build_options(self.args.options, picked, runs)))
            else:  # zero-padded heads so the Torus schedule runs (strategies/padded.py)
                mesh = choose_mesh(topology, heads, spec.placement)
                if self.rank == 0:
                    log_once(logger, f"auto-pad-{name}-{self.num_heads}-{topology}",
                             padding_message(self.num_heads, heads, topology, f"auto: {name}"))
                child = build_padded(spec, replace(self.args, mesh=mesh,
                                                   groups=self.args.groups.for_mesh(mesh),
                                                   options=build_options(self.args.options, picked,
                                                                         spec)),
                                     heads)
            self.meshes[key] = mesh
            self._children[key] = child
            self.comms.extend(c for c in child.comms if c not in self.comms)
        return self._children[key]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 joint: Joint | None, scale: float, key_mask: KeyMask | None = None) -> torch.Tensor:
        Tj = joint.length if joint is not None else 0
        masked = key_mask is not None
        sig = (tuple(q.shape), q.dtype, q.device.type, Tj, masked)
        child = self._by_signature.get(sig)
        if child is None:
            # a key mask runs only on the core strategies, not on xFuser's groups
            best, cands, profile, cmp = choose_cut(
                self.topology, self.num_heads, q, self._external_ulysses(),
                self.args.options.get("external", True) and not masked,
                self.args.options.get("pad_heads", True), self.detected, self.cuts,
                pinned_pieces(self.args.options))
            topo = (self.topology, *self.cuts)[cmp[0]] if cmp else self.topology
            key = (best.strategy, best.ulysses)
            child = self._by_signature[sig] = self._child(*key, best.heads, topo, best.options)
            self.choices[sig] = key
            self.picked[sig] = dict(best.options)
            if cmp:
                self.topologies[sig] = topo
            if self.rank == 0 and cmp:
                _, compared, missing = cmp
                log_once(logger, f"auto-cut-{sig}", "auto: levels compete: " + "; ".join(
                    f"{t} ({p.name}): {b.label} U{b.ulysses}xR{b.ring} {b.latency_s * 1e3:.2f} ms"
                    for t, p, b in compared) + (
                    f"; not compared (the profile has no rates for them): {', '.join(map(str, missing))}"
                    if missing else "") + f"; runs on {topo}", logging.INFO)
            if self.rank == 0:   # every rank picks the same (module docstring)
                alts = ", ".join(f"{p.label} U{p.ulysses}xR{p.ring}"
                                 f"{f' ({p.heads} heads)' if p.padded else ''} {p.latency_s * 1e3:.2f} ms"
                                 for p in sorted(cands, key=lambda p: p.latency_s))
                log_once(logger, f"auto-{sig}",
                         f"auto: {best.label} U{best.ulysses}xR{best.ring} for B={q.shape[0]} "
                         f"S_local={q.shape[2]} D={q.shape[3]} {q.dtype} on {topo} "
                         f"({profile} profile); predicted per layer: {alts}", logging.INFO)
                why = why_baseline(best, cands, hardware_profile(q.device, self.topology, self.detected))
                if why:
                    log_once(logger, f"auto-why-{profile}-{topo}",
                             f"auto (why {best.strategy}): {why}")
        k, v, joint, kwargs = call_args(child.spec, q, k, v, joint, key_mask)
        return child(q, k, v, joint, scale, **kwargs)

    def plan_children(self) -> list:
        return list(self._children.values())

    def close(self, failed: bool) -> None:
        for child in self._children.values():
            child.close(failed)


SPEC = register(StrategySpec(
    "auto", "tas", "the strategy and Ulysses degree the cost model predicts fastest per shape",
    build=AutoAttention, order=4, native=NATIVE))
AutoAttention.spec = SPEC
