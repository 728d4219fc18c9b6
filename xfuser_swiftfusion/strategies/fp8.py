"""FP8 wire format of the inter-machine transfers (option ``fp8_comms``).

A wire slot is one contiguous ``uint8`` run that moves in ONE transfer: the payloads of its
``P`` parts (tensors: Q, or K and V of a packed slot, or O), each ``m`` elements of
``torch.float8_e4m3fn``, then their ``P`` fp32 scales (4 bytes each)::

    [ part 0: m fp8 | ... | part P-1: m fp8 | scale 0: fp32 | ... | scale P-1: fp32 ]

Scale of a part = ``amax / 448`` (e4m3's largest finite value), 1 where ``amax = 0``; a part
is sent as ``clamp(x / scale, -448, 448)`` rounded to e4m3 and arrives as ``fp8 * scale`` in
the compute dtype. Relative error per element is at most 2^-4 of its magnitude (3 mantissa
bits, round to nearest) plus ``scale * 2^-9`` near zero (subnormals). A non-finite input
makes its part's scale non-finite, so the whole part arrives as NaN (not silently clipped).

Bytes of a slot: ``P * (m + 4)``, half of bf16/fp16's ``2 P m`` plus the scales. Gloo, NCCL
and NVSHMEM move the ``uint8`` bytes; symmetric wire buffers are ``uint8`` too.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from .. import plan
from ..comm.base import Handle

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
SCALE_BYTES = 4  # one fp32 scale per part
OPTION = "fp8_comms"


def enabled(options: dict) -> bool:
    """``options["fp8_comms"]`` (default False); ``TypeError`` unless a bool."""
    value = options.get(OPTION, False)
    if not isinstance(value, bool):
        raise TypeError(f"option {OPTION!r} must be True or False, got {value!r}")
    return value


def wire_bytes(m: int, parts: int = 1) -> int:
    """Bytes of one wire slot of ``parts`` parts of ``m`` elements each."""
    return parts * (m + SCALE_BYTES)


def wire_empty(empty: Callable[[tuple[int, ...], torch.dtype], torch.Tensor],
               lead: tuple[int, ...], m: int, parts: int = 1) -> torch.Tensor:
    """A ``uint8`` ``[*lead, wire_bytes(m, parts)]`` buffer from ``empty(shape, dtype)``
    (``torch.empty`` with a device, or a symmetric allocator)."""
    return empty((*lead, wire_bytes(m, parts)), torch.uint8)


def quantize_(wire: torch.Tensor, *parts: torch.Tensor) -> torch.Tensor:
    """Write ``parts`` (each ``[*lead, ...]``, ``m`` elements per lead index, any float
    dtype, any strides) into ``wire`` ``uint8`` ``[*lead, P*(m + 4)]``, one scale per
    (lead index, part). Returns ``wire``."""
    lead, P = wire.shape[:-1], len(parts)
    m = wire.shape[-1] // P - SCALE_BYTES
    if m <= 0 or wire.shape[-1] != wire_bytes(m, P) or wire.dtype != torch.uint8:
        raise ValueError(f"wire {tuple(wire.shape)} {wire.dtype} is not a uint8 slot of {P} parts")
    payload = wire[..., :P * m].view(FP8).view(*lead, P, m)  # [*lead, P*m] bytes -> [*lead, P, m] fp8
    scales = torch.empty(*lead, P, dtype=torch.float32, device=wire.device)  # [*lead, P]
    for p, x in enumerate(parts):
        xs = x.reshape(*lead, m).float()  # [*lead, ...] -> [*lead, m] (fp32 copy)
        amax = xs.abs().amax(-1, keepdim=True)  # [*lead, 1]
        scale = torch.where(amax == 0, torch.ones_like(amax), amax / FP8_MAX)  # NaN stays NaN
        payload[..., p, :].copy_((xs / scale).clamp_(-FP8_MAX, FP8_MAX))  # rounds to e4m3
        scales[..., p] = scale[..., 0]
    # fp32 [*lead, P] -> bytes [*lead, 4P], after the payloads
    wire[..., P * m:].copy_(scales.view(torch.uint8).view(*lead, P * SCALE_BYTES))
    return wire


def dequantize_(wire: torch.Tensor, *outs: torch.Tensor) -> None:
    """Read ``wire`` ``uint8`` ``[*lead, P*(m + 4)]`` into ``outs`` (P tensors ``[*lead, ...]``
    of ``m`` elements per lead index, any strides; cast to their dtype)."""
    lead, P = wire.shape[:-1], len(outs)
    m = wire.shape[-1] // P - SCALE_BYTES
    payload = wire[..., :P * m].view(FP8).view(*lead, P, m)  # [*lead, P*m] bytes -> [*lead, P, m] fp8
    raw = torch.empty(*lead, P * SCALE_BYTES, dtype=torch.uint8, device=wire.device)
    raw.copy_(wire[..., P * m:])  # aligned copy of the scale bytes
    scales = raw.view(torch.float32)  # [*lead, 4P] bytes -> [*lead, P] fp32
    for p, out in enumerate(outs):
        x = payload[..., p, :].float() * scales[..., p:p + 1]  # [*lead, m]
        out.copy_(x.view(out.shape))  # [*lead, m] -> [*lead, ...]


class Arrival(Handle):
    """Completion of ``handles`` followed by ``then()`` (the dequantization of what they
    brought, a plan's step), once: later waits return at once."""

    def __init__(self, handles: Sequence[Handle], then: Callable[[], None]) -> None:
        self._handles, self._then = list(handles), then

    def wait(self) -> None:
        if self._then is None:
            return
        for h in self._handles:
            h.wait()
        then, self._then = self._then, None
        plan.call(then)


__all__ = ["Arrival", "FP8", "FP8_MAX", "OPTION", "SCALE_BYTES", "dequantize_", "enabled",
           "quantize_", "wire_bytes", "wire_empty"]
