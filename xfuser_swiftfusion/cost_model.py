"""Latency of one attention layer for every strategy, from the code's own schedules.

Inputs: topology (N machines x M GPUs), ``Workload`` (B, L, H, D, dtype), mesh degrees, and a
``HardwareProfile`` (``hardware.py``: measured by ``swiftfusion calibrate`` or built in).
Output: ``Prediction`` (seconds per attention layer, with the compute and the host's issue
time beside it).

Nothing here restates a schedule: each strategy's ``program`` (``strategies/ops.py``) expands
the step list the strategy executes (``torus_schedule``, ``ring_schedule``,
``tas_schedule``; usp: the steps of xFuser's USP) into the calls one rank makes, and
``timeline.simulate`` runs every rank's calls on the profile's rates: compute, each machine's
links per direction shared by the transfers in flight, per-call host cost, barriers. A change
to a schedule changes the prediction without an edit here (tests/test_cost_model.py). The
baseline (``usp``: xFuser's code makes its calls, not ours) runs on the profile's
``baseline`` compute costs where it has them (``HardwareProfile.for_baseline``).

Zero-padded heads (``mesh.torus_mesh``, ``strategies/padded.py``): a strategy that needs the
Torus schedule, at the default degree, on a mesh that is not torus-ready runs on ``H'`` heads
as ``init_sequence_parallel`` runs it (unless ``pad_heads=False``): the programs use ``H'``
(compute and bytes), and ``Prediction.heads`` is ``H'``.

K/V pieces (``strategies/torus.py``, option ``kv_pieces`` P): ``candidates`` predicts each
strategy whose spec takes the option at P = 1 and, where the mesh has a torus degree T > 1,
at P in ``KV_PIECES`` up to the tokens per GPU (``Prediction.options``: what its child is
built with); a P the caller pins is the only one predicted. Ties go to fewer pieces.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Sequence

from .hardware import (CPU_PROFILE_PATH, GPU_PROFILES, HARDWARE_ENV, LINK_ENV, PROFILES,
                       HardwareProfile, Rate, cpu_profile, get_profile, host_cpu, load_profile)
from .mesh import Mesh, choose_mesh, counted_inter_node_elements, torus_mesh
from .strategies.ops import Shape, sent_bytes
from .strategies.registry import StrategySpec, get, modelled
from .timeline import simulate
from .topology import Topology, TopologyError

BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
KV_PIECES = (2, 4)  # the pieces P > 1 ``candidates`` tries (module docstring)


@dataclass(frozen=True)
class Workload:
    """One attention layer: batch, global sequence length, heads, head dim, dtype."""

    batch: int
    seq_len: int
    heads: int
    head_dim: int
    dtype: str = "bf16"


@dataclass(frozen=True)
class Prediction:
    """Predicted latency of one attention layer (the slowest rank)."""

    strategy: str      # requested
    runs_as: str       # what init_sequence_parallel runs (torus/swiftfusion -> tas if not torus_ready)
    ulysses: int
    ring: int
    placement: str
    latency_s: float
    compute_s: float   # the slowest rank's compute calls alone (no communication beside them)
    inter_node_bytes: int  # per rank (max over ranks)
    breakdown: dict[str, float] = field(default_factory=dict)
    heads: int = 0     # heads it runs on: the workload's, or H' when zero-padded
    padded: bool = False  # runs on zero-padded heads (heads > the workload's)
    host_s: float = 0.0   # when the slowest rank's host finished issuing its calls
    host_bound: bool = False  # its host runs ahead of the device (GPU) and issues the calls
    # slower than the device computes them: the device waits for the host
    options: dict = field(default_factory=dict)  # the program options it runs with (kv_pieces)

    @property
    def pieces(self) -> int:
        """``kv_pieces`` P it runs with (1: none)."""
        return int(self.options.get("kv_pieces", 1))

    @property
    def label(self) -> str:
        """The strategy's name, with ``[P=..]`` where it runs K/V pieces."""
        return self.strategy + (f"[P={self.pieces}]" if self.pieces != 1 else "")

    @property
    def exposed_comm_s(self) -> float:
        return self.latency_s - self.compute_s


def _mesh(spec: StrategySpec, topology: Topology, workload: Workload, ulysses_degree: int | None,
          pad_heads: bool) -> tuple[Mesh, StrategySpec, Workload]:
    """The mesh, the spec that runs on it (after its fallback) and the workload it runs (its
    heads: more than ``workload``'s when zero-padded)."""
    if spec.needs_torus:
        mesh, padded = torus_mesh(topology, workload.heads, spec.placement, ulysses_degree,
                                  pad=pad_heads)
        workload = replace(workload, heads=padded)
    else:
        mesh = choose_mesh(topology, workload.heads, spec.placement, ulysses_degree)
    return mesh, spec.resolve(mesh, log=False), workload


def programs(spec: StrategySpec, mesh: Mesh, w: Workload, launches: str | None = None,
             options: dict | None = None) -> list[list]:
    """Every rank's ops (``strategies/ops.py``) for one layer of ``w`` under ``spec``, with the
    Torus strategies' attention ``launches`` (``"ring"`` / ``"stage"``; None: their program's
    default) where the spec has launch modes, and those of the strategy ``options`` its
    program takes (``spec.program_options``, e.g. torus's ``kv_pieces``)."""
    W = mesh.world_size
    if w.seq_len % W:
        raise TopologyError(f"sequence length {w.seq_len} is not divisible by the SP degree {W}")
    if spec.program is None:
        raise ValueError(f"no cost model for strategy {spec.name!r} (it has no program)")
    shape = Shape(w.batch, w.seq_len // W, w.heads, w.head_dim, 0, BYTES[w.dtype])
    kw = {"launches": launches} if launches is not None and spec.launch_modes else {}
    kw |= {k: v for k, v in (options or {}).items() if k in spec.program_options}
    return [spec.program(mesh, x, shape, **kw) for x in range(W)]


def predict(strategy: str, topology: Topology, workload: Workload, profile: HardwareProfile,
            ulysses_degree: int | None = None, pad_heads: bool = True,
            options: dict | None = None) -> Prediction:
    """Latency of one attention layer for ``strategy`` with Ulysses degree ``ulysses_degree``
    (default ``gcd(N*M, H)``), as ``init_sequence_parallel`` runs it: on zero-padded heads
    where the Torus schedule needs them (``pad_heads``, default degree only), else with the
    spec's fallback; ``options``: strategy options its program takes (``programs``)."""
    spec = get(strategy)
    mesh, runs, w = _mesh(spec, topology, workload, ulysses_degree, pad_heads)
    prof = profile.for_baseline() if runs.baseline else profile
    res = simulate(programs(runs, mesh, w, prof.launches, options), topology, prof, w.dtype, w.head_dim)
    x = max(range(len(res.finish_s)), key=res.finish_s.__getitem__)
    per_rank = counted_inter_node_elements(mesh, w.batch, w.seq_len, w.heads, w.head_dim, runs.ring)
    taken = {k: v for k, v in (options or {}).items() if k in runs.program_options}
    return Prediction(spec.name, runs.name, mesh.ulysses, mesh.ring, spec.placement,
                      res.finish_s[x], res.compute_s[x], max(per_rank) * BYTES[w.dtype],
                      {"critical_rank": x, "fastest_rank_s": min(res.finish_s)},
                      w.heads, w.heads != workload.heads, res.host_s[x],
                      not prof.host_waits and res.host_s[x] > res.compute_s[x], taken)


def inter_node_elements(strategy: str, topology: Topology, workload: Workload,
                        ulysses_degree: int | None = None, pad_heads: bool = True) -> float:
    """Inter-machine elements the programs move, max over ranks (counted as the communicators
    count them: sends and puts at the sender, gets at the initiator)."""
    mesh, runs, w = _mesh(get(strategy), topology, workload, ulysses_degree, pad_heads)
    node = topology.node_of
    per_rank = [sent_bytes(ops, {p for p in range(topology.world_size) if node(p) != node(x)})
                for x, ops in enumerate(programs(runs, mesh, w))]
    return max(per_rank) / BYTES[w.dtype]


def refused(spec: StrategySpec, profile: HardwareProfile) -> str | None:
    """Why ``spec`` cannot run on ``profile``'s hardware (None: it can): the one-sided
    strategy (NVSHMEM) needs GPU peer-to-peer inside a host."""
    if spec.one_sided and not profile.p2p:
        return (f"{spec.name} needs GPU peer-to-peer inside a host (NVSHMEM over PCIe or NVLink); "
                f"profile {profile.name} has none (peer-to-peer off, e.g. GeForce cards)")
    return None


def host_topology(nodes: int, gpus_per_node: int, profile: HardwareProfile) -> Topology:
    """The topology to plan ``nodes`` x ``gpus_per_node`` on ``profile``: a one-box profile
    (``island_gpus``) cuts one host into its islands; else as given."""
    i = profile.island_gpus
    if not i:
        return Topology(nodes, gpus_per_node)
    if nodes != 1:
        raise TopologyError(f"profile {profile.name} describes one host of {i}-GPU islands, not "
                            f"{nodes} machines: use --nodes 1, or a cluster profile")
    if gpus_per_node <= i or gpus_per_node % i:
        return Topology(1, gpus_per_node)
    return Topology(gpus_per_node // i, i)


def cut_options(topology: Topology, profile: HardwareProfile,
                alternatives: Sequence[Topology] = ()) -> tuple[list[tuple[Topology, HardwareProfile]],
                                                                list[Topology]]:
    """The cuts the model compares: ``(topology, profile)`` first, then each finer cut of
    ``alternatives`` (same ranks, fewer GPUs per machine) on the profile's rates for it
    (``HardwareProfile.at_level``); second, the alternatives it has no rates for."""
    out, missing = [(topology, profile)], []
    for alt in alternatives:
        if alt.world_size != topology.world_size or any(alt == t for t, _ in out):
            continue
        prof = profile.at_level(alt.gpus_per_node)
        if prof is None:
            missing.append(alt)
        else:
            out.append((alt, prof))
    return out, missing


def host_topologies(nodes: int, gpus_per_node: int,
                    profile: HardwareProfile) -> list[tuple[Topology, HardwareProfile]]:
    """``host_topology`` on ``profile`` first, then each finer cut the profile has rates for
    (``levels``): ``nodes * gpus_per_node / k`` machines of ``k`` GPUs."""
    topo = host_topology(nodes, gpus_per_node, profile)
    W = topo.world_size
    alts = [Topology(W // int(lv["gpus"]), int(lv["gpus"])) for lv in profile.levels
            if 1 < int(lv["gpus"]) < topo.gpus_per_node and topo.gpus_per_node % int(lv["gpus"]) == 0]
    return cut_options(topo, profile, alts)[0]


def recommend_cut(options: Sequence[tuple[Topology, HardwareProfile]], workload: Workload,
                  usp_ulysses: int | None = None, external: bool = True, pad_heads: bool = False,
                  kv_pieces: int | None = None
                  ) -> tuple[int, list[Prediction], list[list[Prediction]]]:
    """``recommend`` on every cut of ``options`` (``cut_options``): the index of the cut
    whose pick is fastest (ties, within 0.1 %, to the earlier: the coarser cut), every cut's
    pick and every cut's candidates. On the finer cuts only strategies on this package's own
    groups compete (``external=False``): groups built outside it (xFuser's, once per process)
    follow the first cut, the one the context is built on. ``kv_pieces``: as ``candidates``."""
    picks, cands = [], []
    for j, (topo, prof) in enumerate(options):
        ext = external and j == 0
        c = [p for p in candidates(topo, workload, prof, pad_heads, kv_pieces)
             if ext or not get(p.strategy).external_groups]
        cands.append(c)
        picks.append(recommend(topo, workload, prof, usp_ulysses, ext, pad_heads, cands=c))
    ref = picks[0].latency_s
    i = min(range(len(picks)), key=lambda j: (round(picks[j].latency_s / ref, 3), j))
    return i, picks, cands


def ulysses_degrees(topology: Topology, heads: int) -> list[int]:
    """Ulysses degrees that divide ``gcd(N*M, H)`` (every one gives a valid mesh)."""
    g = math.gcd(topology.world_size, heads)
    return [d for d in range(1, g + 1) if g % d == 0]


def piece_options(spec: StrategySpec, mesh: Mesh, workload: Workload,
                  kv_pieces: int | None = None) -> list[dict]:
    """The program options ``candidates`` predicts ``spec`` with on ``mesh``: ``{}`` (P = 1)
    and, where the spec takes ``kv_pieces`` and the mesh's torus degree is > 1, each P in
    ``KV_PIECES`` up to the tokens per GPU; ``kv_pieces`` (the caller's): that P only."""
    if "kv_pieces" not in spec.program_options:
        return [{}]
    if kv_pieces is not None:
        return [{"kv_pieces": kv_pieces}]
    tokens = workload.seq_len // mesh.world_size
    return [{}] + [{"kv_pieces": P} for P in KV_PIECES if mesh.torus > 1 and P <= tokens]


def candidates(topology: Topology, workload: Workload, profile: HardwareProfile,
               pad_heads: bool = False, kv_pieces: int | None = None) -> list[Prediction]:
    """Every (strategy, Ulysses degree, program options) that runs as itself, predicted: the
    strategies that take ``kv_pieces`` at every P of ``piece_options`` (``kv_pieces``: the
    caller's P, the only one; None: the model chooses); with ``pad_heads`` also each
    Torus-schedule strategy on zero-padded heads where its default mesh needs them
    (``Prediction.heads`` > the workload's; its ``ulysses`` is the padded mesh's)."""
    out = []
    for deg in ulysses_degrees(topology, workload.heads):
        for spec in modelled():
            if refused(spec, profile):
                continue
            mesh, runs, _ = _mesh(spec, topology, workload, deg, False)
            if runs.name == spec.name:
                out += [predict(spec.name, topology, workload, profile, deg, options=o)
                        for o in piece_options(spec, mesh, workload, kv_pieces)]
    if pad_heads:
        for spec in modelled():
            if spec.needs_torus and not refused(spec, profile):
                mesh, runs, w = _mesh(spec, topology, workload, None, True)
                if w.heads != workload.heads and runs.name == spec.name:
                    out += [predict(spec.name, topology, workload, profile, None, True, o)
                            for o in piece_options(spec, mesh, w, kv_pieces)]
    return out


def recommend(topology: Topology, workload: Workload, profile: HardwareProfile,
              usp_ulysses: int | None = None, external: bool = True,
              pad_heads: bool = False, cands: list[Prediction] | None = None,
              kv_pieces: int | None = None) -> Prediction:
    """The fastest candidate by the model; ties (within 0.1%) go to the earlier strategy in
    the registry's order, the larger Ulysses degree, then fewer K/V pieces. Never predicted slower than the
    baseline (``usp`` at its default degree). ``usp_ulysses``: the only Ulysses degree a
    strategy on xFuser's existing groups may use (they are built already). ``external=False``:
    no strategy on groups built outside this package (no xFuser: diffusers' integration).
    ``pad_heads``: Torus-schedule strategies on zero-padded heads are candidates too (the
    caller must then build a pick with ``heads`` > H padded, ``strategies/padded.py``).
    ``cands``: ``candidates(topology, workload, profile, pad_heads, kv_pieces)`` where
    already at hand."""
    specs = {s.name: s for s in modelled()
             if (external or not s.external_groups) and not refused(s, profile)}
    if cands is None:
        cands = candidates(topology, workload, profile, pad_heads, kv_pieces)
    cands = [p for p in cands if p.strategy in specs
             and (not specs[p.strategy].external_groups or usp_ulysses in (None, p.ulysses))]
    order = list(specs)
    baselines = [s for s in specs.values() if s.baseline]
    base = (predict(baselines[0].name, topology, workload, profile, usp_ulysses)
            if baselines else None)
    ref = base.latency_s if base is not None else min(p.latency_s for p in cands)
    best = min(cands, key=lambda p: (round(p.latency_s / ref, 3), order.index(p.strategy),
                                     -p.ulysses, p.pieces))
    return best if base is None or best.latency_s <= base.latency_s else base


def why_baseline(best: Prediction, cands: list[Prediction], profile: HardwareProfile) -> str | None:
    """Why ``best`` (``recommend``'s pick among ``cands``) is the baseline, when it is: its
    prediction beside each other strategy's fastest candidate and what bounds that one (its
    host, or its GPU work and the communication it does not hide); else None."""
    if not get(best.strategy).baseline:
        return None
    fastest: dict[str, Prediction] = {}
    for c in sorted(cands, key=lambda c: c.latency_s):
        if not get(c.strategy).baseline:
            fastest.setdefault(c.strategy, c)
    if not fastest:
        return None
    ms = lambda s: f"{s * 1e3:.2f} ms"  # noqa: E731
    alts = ", ".join(
        f"{c.label} {ms(c.latency_s)} ("
        + (f"host-bound: host {ms(c.host_s)}, GPU {ms(c.compute_s)}" if c.host_bound else
           f"compute {ms(c.compute_s)}, communication not hidden {ms(c.exposed_comm_s)}") + ")"
        for c in fastest.values())
    return (f"{best.label} U{best.ulysses}xR{best.ring} predicted {ms(best.latency_s)} per layer on "
            f"profile {profile.name} ({profile.origin()}), faster than {alts}")


__all__ = ["BYTES", "CPU_PROFILE_PATH", "GPU_PROFILES", "HARDWARE_ENV", "HardwareProfile",
           "KV_PIECES", "LINK_ENV", "PROFILES", "Prediction", "Rate", "Workload", "candidates",
           "cpu_profile", "cut_options", "get_profile", "host_cpu", "host_topologies",
           "host_topology", "inter_node_elements", "load_profile", "piece_options", "predict",
           "programs", "recommend", "recommend_cut", "refused", "ulysses_degrees", "why_baseline"]
