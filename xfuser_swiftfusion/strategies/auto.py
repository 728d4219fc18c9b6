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
profile and topology (``cost_model.why_baseline``).
"""
from __future__ import annotations

import logging
import os
from dataclasses import replace

import torch

from ..cost_model import Workload, candidates, get_profile, recommend, why_baseline
from ..hardware import BOX_OF_GPU, HARDWARE_ENV, HardwareProfile
from ..hwtopo import HostIslands, last_detection
from ..log import get_logger, log_once
from ..mesh import Mesh, choose_mesh
from ..topology import Topology
from .layout import Joint, KeyMask
from .padded import build_padded, padding_message
from .registry import NATIVE, BuildArgs, Strategy, StrategySpec, call_args, get, register, specs

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


def choose(topology: Topology, num_heads: int, q: torch.Tensor, usp_ulysses: int | None = None,
           external: bool = True, pad_heads: bool = True, detected: HostIslands | None = None):
    """The model's pick for local queries ``q`` [B, H, S_local, D] (pure: same on every rank);
    text tokens are not modelled (they add the same replicated work to every strategy).
    ``usp_ulysses``: the Ulysses degree of xFuser's existing groups, the only one usp can use;
    ``external=False``: no strategy on xFuser's groups at all; ``detected``: the host's
    islands read from NVML at init (``hwtopo.last_detection``)."""
    B, _, S, D = q.shape
    dtype = DTYPES.get(q.dtype, "fp32")
    w = Workload(B, S * topology.world_size, num_heads, D, dtype)
    # the model depends on machines x GPUs only, not on which ranks an island holds
    plain = Topology(topology.nodes, topology.gpus_per_node)
    profile = hardware_profile(q.device, plain, detected)
    return (recommend(plain, w, profile, usp_ulysses, external, pad_heads),
            candidates(plain, w, profile, pad_heads), profile.name)


class AutoAttention:
    """Callable ``(q, k, v, joint, scale, key_mask=)`` under the USP contract (K/V may have
    fewer heads, ``layout``); delegates to the child
    strategy the model picks per input signature. Children are built (collectively) at the
    first call that picks them, from the parent's ``BuildArgs`` with their own mesh, and are
    shared between signatures that pick the same (strategy, Ulysses degree).
    ``args.options``: ``usp_ulysses``, the Ulysses degree of xFuser's existing groups, if any;
    ``external`` (default True), False to never pick a strategy on xFuser's groups; the
    children get every option (``fp8_comms`` included; the cost model prices compute-dtype
    transfers)."""

    detected: HostIslands | None = None  # the host's islands read from NVML at init, if any

    def __init__(self, args: BuildArgs) -> None:
        self.args = args
        self.topology, self.num_heads, self.rank = args.mesh.topology, args.num_heads, args.rank
        self.comms: list = []
        self._by_signature: dict[tuple, Strategy] = {}
        self._children: dict[tuple[str, int, int], Strategy] = {}
        self.choices: dict[tuple, tuple[str, int]] = {}
        self.meshes: dict[tuple[str, int, int], Mesh] = {}  # (strategy, ulysses, heads) -> mesh
        self.detected = last_detection()

    def _external_ulysses(self) -> int | None:
        """The only Ulysses degree a strategy on external groups can run now: the option
        ``usp_ulysses``, else the degree of such groups that already exist in this process (xFuser's
        state, built by xFuser, another context or an earlier child), else None (any)."""
        given = self.args.options.get("usp_ulysses")
        if given is not None:
            return given
        built = (s.built_ulysses() for s in specs() if s.external_groups and s.built_ulysses)
        return next((d for d in built if d is not None), None)

    def _child(self, name: str, ulysses: int, heads: int) -> Strategy:
        key = (name, ulysses, heads)
        if key not in self._children:
            spec = get(name)
            if heads == self.num_heads:
                mesh = choose_mesh(self.topology, self.num_heads, spec.placement, ulysses)
                child = spec.resolve(mesh).build(
                    replace(self.args, mesh=mesh, groups=self.args.groups.for_mesh(mesh)))
            else:  # zero-padded heads so the Torus schedule runs (strategies/padded.py)
                mesh = choose_mesh(self.topology, heads, spec.placement)
                if self.rank == 0:
                    log_once(logger, f"auto-pad-{name}-{self.num_heads}-{self.topology}",
                             padding_message(self.num_heads, heads, self.topology, f"auto: {name}"))
                child = build_padded(spec, replace(self.args, mesh=mesh,
                                                   groups=self.args.groups.for_mesh(mesh)), heads)
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
            best, cands, profile = choose(self.topology, self.num_heads, q,
                                          self._external_ulysses(),
                                          self.args.options.get("external", True) and not masked,
                                          self.args.options.get("pad_heads", True),
                                          self.detected)
            key = (best.strategy, best.ulysses)
            child = self._by_signature[sig] = self._child(*key, best.heads)
            self.choices[sig] = key
            if self.rank == 0:   # every rank picks the same (module docstring)
                alts = ", ".join(f"{p.strategy} U{p.ulysses}xR{p.ring}"
                                 f"{f' ({p.heads} heads)' if p.padded else ''} {p.latency_s * 1e3:.2f} ms"
                                 for p in sorted(cands, key=lambda p: p.latency_s))
                log_once(logger, f"auto-{sig}",
                         f"auto: {best.strategy} U{best.ulysses}xR{best.ring} for B={q.shape[0]} "
                         f"S_local={q.shape[2]} D={q.shape[3]} {q.dtype} on {self.topology} "
                         f"({profile} profile); predicted per layer: {alts}", logging.INFO)
                why = why_baseline(best, cands, hardware_profile(q.device, self.topology, self.detected))
                if why:
                    log_once(logger, f"auto-why-{profile}-{self.topology}",
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
