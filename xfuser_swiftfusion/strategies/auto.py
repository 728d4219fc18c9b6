"""``auto``: the strategy and Ulysses degree the cost model predicts fastest, per input shape.

The sequence length is known only at the first attention call, so the choice is made lazily,
per input signature ``(B, S_local, D, dtype, text tokens)``, by ``cost_model.recommend`` — a pure
function of inputs every rank shares (topology, heads, shape, hardware profile), so all ranks
pick the same strategy without communicating. The chosen strategy's context is created at that
first call (collective on every rank, as ``init_sequence_parallel`` is) and cached; contexts
are shared between signatures that pick the same (strategy, degree).

Hardware profile: ``cpu-emulated`` on CPU tensors; on CUDA ``$SWIFTFUSION_HARDWARE`` (default
``p4de``). The model never predicts the choice slower than default ``usp``.
"""
from __future__ import annotations

import logging
import os
from typing import Callable

import torch

from ..cost_model import Workload, candidates, get_profile, recommend
from ..log import get_logger, log_once
from ..topology import Topology
from .layout import Joint

logger = get_logger(__name__)

HARDWARE_ENV = "SWIFTFUSION_HARDWARE"
DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def hardware_profile_name(device: torch.device) -> str:
    """``cpu-emulated`` for CPU tensors, else ``$SWIFTFUSION_HARDWARE`` or ``p4de``."""
    return "cpu-emulated" if device.type == "cpu" else os.environ.get(HARDWARE_ENV, "p4de")


def choose(topology: Topology, num_heads: int, q: torch.Tensor, usp_ulysses: int | None = None):
    """The model's pick for local queries ``q`` [B, H, S_local, D] (pure: same on every rank);
    text tokens are not modelled (they add the same replicated work to every strategy).
    ``usp_ulysses``: the Ulysses degree of xFuser's existing groups, the only one usp can use."""
    B, _, S, D = q.shape
    dtype = DTYPES.get(q.dtype, "fp32")
    w = Workload(B, S * topology.world_size, num_heads, D, dtype)
    profile = get_profile(hardware_profile_name(q.device), topology)
    return (recommend(topology, w, profile, usp_ulysses), candidates(topology, w, profile),
            profile.name)


def _existing_usp_ulysses() -> int | None:
    """Ulysses degree of xFuser's parallel state when it already exists (plugin sessions)."""
    from ..xfuser_state import xfuser_parallel_initialized, xfuser_sp_layout
    return xfuser_sp_layout()[0] if xfuser_parallel_initialized() else None


class AutoAttention:
    """Callable ``(q, k, v, joint, scale)`` under the USP contract; delegates to the chosen
    strategy's context. ``make_context(strategy, ulysses_degree)`` builds one (collective)."""

    name = "auto"

    def __init__(self, topology: Topology, num_heads: int, rank: int,
                 make_context: Callable[[str, int], object], comms: list) -> None:
        self.topology, self.num_heads, self.rank = topology, num_heads, rank
        self._make, self._comms = make_context, comms
        self._by_signature: dict[tuple, object] = {}
        self._contexts: dict[tuple[str, int], object] = {}
        self.choices: dict[tuple, tuple[str, int]] = {}

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 joint: Joint | None, scale: float) -> torch.Tensor:
        Tj = joint.length if joint is not None else 0
        sig = (tuple(q.shape), q.dtype, q.device.type, Tj)
        ctx = self._by_signature.get(sig)
        if ctx is None:
            best, cands, profile = choose(self.topology, self.num_heads, q, _existing_usp_ulysses())
            key = (best.strategy, best.ulysses)
            if key not in self._contexts:
                ctx = self._make(*key)
                self._contexts[key] = ctx
                self._comms.extend(ctx._comms)  # the parent context reports and closes them
            ctx = self._by_signature[sig] = self._contexts[key]
            self.choices[sig] = key
            alts = ", ".join(f"{p.strategy} U{p.ulysses}xR{p.ring} {p.latency_s * 1e3:.2f} ms"
                             for p in sorted(cands, key=lambda p: p.latency_s))
            log_once(logger, f"auto-{sig}",
                     f"auto: {best.strategy} U{best.ulysses}xR{best.ring} for B={q.shape[0]} "
                     f"S_local={q.shape[2]} D={q.shape[3]} {q.dtype} on {self.topology} "
                     f"({profile} profile); predicted per layer: {alts}", logging.INFO)
        jargs = {} if joint is None else dict(joint_query=joint.q, joint_key=joint.k,
                                              joint_value=joint.v, joint_strategy=joint.strategy)
        return ctx.attention(q, k, v, scale=scale, **jargs)

    def close(self) -> None:
        """Tear down what the chosen contexts own besides their communicators (xFuser state)."""
        for ctx in self._contexts.values():
            ctx._comms.clear()  # closed by the parent context
            ctx.close()
