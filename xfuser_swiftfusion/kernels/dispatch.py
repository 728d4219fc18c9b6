"""Backend selection and the public ``attend`` entry point.

Backends: "triton" (fused multi-chunk kernel, default on CUDA; also runs on CPU tensors under
``TRITON_INTERPRET=1``), "flash" (flash-attn per pair + merge, CUDA only), "cpu" (torch's CPU
flash attention + merge, default elsewhere). Precedence: ``set_backend(name)`` >
env ``SWIFTFUSION_KERNEL`` > device default. The choice per device type is cached and logged
once.
"""
from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence

import torch

from ..log import get_logger, log_once
from .state import AttnState, finalize as finalize_state

logger = get_logger("xfuser_swiftfusion.kernels")

BACKENDS = ("triton", "flash", "cpu")
ENV_VAR = "SWIFTFUSION_KERNEL"

_override: str | None = None
_chosen: dict[str, str] = {}  # device type -> backend name


def _missing(name: str, device: torch.device) -> str | None:
    """Why backend ``name`` cannot run on ``device``, or None if it can."""
    if name == "cpu":
        return None if device.type == "cpu" else f"CPU tensors (got a {device.type} device)"
    if name == "flash":
        if device.type != "cuda":
            return f"a CUDA device (got {device.type})"
        if importlib.util.find_spec("flash_attn") is None:
            return "the flash_attn package (pip install flash-attn)"
        return None
    if importlib.util.find_spec("triton") is None:
        return "the triton package"
    if device.type == "cuda":
        return None
    return None if interpreting() else f"a CUDA device or TRITON_INTERPRET=1 (got {device.type})"


def interpreting() -> bool:
    """True when Triton runs its CPU interpreter (``TRITON_INTERPRET=1``). Read without
    importing triton: triton.jit decides at decoration time whether to interpret."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def select_backend(device: torch.device, override: str | None = None) -> str:
    """Backend name for ``device``: ``override``, else env SWIFTFUSION_KERNEL, else "auto":
    "triton" on CUDA (then "flash" if triton cannot run, logged once) and "cpu" elsewhere.
    Raises ValueError / RuntimeError if the request is unknown or cannot run here."""
    device = torch.device(device)
    name = override or os.environ.get(ENV_VAR) or "auto"
    if name == "auto":
        order = ("triton", "flash") if device.type == "cuda" else ("cpu",)
        usable = [n for n in order if _missing(n, device) is None]
        if not usable:
            raise RuntimeError(f"no attention kernel can run on {device.type}: "
                               + "; ".join(f"{n} needs {_missing(n, device)}" for n in order))
        if usable[0] != order[0]:
            log_once(logger, f"kernel-auto-{device.type}",
                     f"kernel auto: {order[0]} needs {_missing(order[0], device)}; using {usable[0]}")
        return usable[0]
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; choose one of ('auto', *{BACKENDS})")
    missing = _missing(name, device)
    if missing is not None:
        raise RuntimeError(f"kernel backend {name!r} needs {missing}")
    return name


def set_backend(name: str | None) -> None:
    """Force backend ``name`` for all later ``attend`` calls (None: back to automatic)."""
    global _override
    if name is not None and name not in (*BACKENDS, "auto"):
        raise ValueError(f"unknown kernel backend {name!r}; choose one of {BACKENDS}")
    _override = name
    _chosen.clear()


def current_backend(device: torch.device) -> str:
    """The (cached) backend ``attend`` uses for tensors on ``device``; logs the first choice."""
    name = _chosen.get(device.type)
    if name is None:
        name = _chosen[device.type] = select_backend(device, _override)
        logger.info("swiftfusion attention kernel backend for %s: %s", device.type, name)
    return name


def _check_args(q_chunks, kv_chunks, states, out) -> None:
    """Shapes, dtypes and devices; every backend relies on these."""
    if len(states) != len(q_chunks) or (out is not None and len(out) != len(q_chunks)):
        raise ValueError("need one state (and one output, if given) per Q chunk")
    B, H, _, D = q_chunks[0].shape
    device = q_chunks[0].device
    for i, (q, s) in enumerate(zip(q_chunks, states)):
        if q.dim() != 4 or (q.shape[0], q.shape[1], q.shape[3]) != (B, H, D):
            raise ValueError(f"Q chunk {tuple(q.shape)} does not match [B={B}, H={H}, L, D={D}]")
        if s.acc.shape != q.shape or s.m.shape != q.shape[:3] or s.l.shape != q.shape[:3]:
            raise ValueError("AttnState shapes do not match their Q chunk")
        if any(t.dtype != torch.float32 or t.device != device for t in (s.acc, s.m, s.l)):
            raise TypeError("AttnState tensors must be fp32 on the device of the queries")
        if out is not None and out[i].shape != q.shape:
            raise ValueError(f"output {tuple(out[i].shape)} does not match its Q chunk {tuple(q.shape)}")
    for k, v in kv_chunks:
        if k.shape != v.shape or k.dim() != 4 or (k.shape[0], k.shape[1], k.shape[3]) != (B, H, D):
            raise ValueError(f"K {tuple(k.shape)} / V {tuple(v.shape)} do not match [B={B}, H={H}, L, D={D}]")
    inputs = [*q_chunks, *(t for kv in kv_chunks for t in kv)]
    if len({t.dtype for t in inputs}) > 1:
        raise TypeError(f"Q, K and V chunks must share one dtype, got {sorted({str(t.dtype) for t in inputs})}")
    if any(t.device != device for t in inputs):
        raise ValueError("all Q, K and V chunks must be on one device")


def attend(
    q_chunks: Sequence[torch.Tensor],
    kv_chunks: Sequence[tuple[torch.Tensor, torch.Tensor]],
    states: Sequence[AttnState],
    *,
    scale: float,
    finalize: bool = False,
    out: Sequence[torch.Tensor] | None = None,
) -> list[torch.Tensor] | None:
    """Full (non-causal) attention of every Q chunk [B, H, Lq_i, D] against every KV chunk
    (K_j, V_j) [B, H, Lk_j, D], merged into ``states[i]`` in place.

    Lengths may be anything, including 0; ``kv_chunks`` may be empty. With ``finalize``, also
    returns the outputs acc / l [B, H, Lq_i, D] in the query dtype (written into ``out[i]`` if
    given); rows that saw no keys at all output 0. Without ``finalize`` returns None.
    """
    q_chunks, kv_chunks = list(q_chunks), list(kv_chunks)
    if not q_chunks:
        return [] if finalize else None
    _check_args(q_chunks, kv_chunks, states, out)
    backend = current_backend(q_chunks[0].device)
    if backend == "triton":
        from .triton_attend import attend_triton

        if finalize and out is None:
            out = [torch.empty_like(q, memory_format=torch.contiguous_format) for q in q_chunks]
        attend_triton(q_chunks, kv_chunks, states, scale, out if finalize else None)
        return list(out) if finalize else None
    if backend == "flash":
        from .flash import attend_flash

        attend_flash(q_chunks, kv_chunks, states, scale)
    else:
        from .cpu import attend_cpu

        attend_cpu(q_chunks, kv_chunks, states, scale)
    if not finalize:
        return None
    return [finalize_state(s, q.dtype, None if out is None else out[i]) for i, (q, s) in enumerate(zip(q_chunks, states))]
