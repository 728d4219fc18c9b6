"""Device copies of the triton kernel's chunk tables, also inside CUDA graph capture.

A launch's table (``[n]`` int64 addresses, strides and lengths) is built on the host and copied
to the device just before the launch. Outside capture the copy reads a pageable temporary
once. A captured copy reads its source again at every replay, and CUDA captures host-to-device
copies from pinned memory only (a pageable one fails the capture). So inside capture each table
goes into its own slice of a pinned arena, written once and never reused: at replay the slice
still holds the addresses the captured launch had (fixed in the graph's memory pool).

The arena (``SWIFTFUSION_GRAPH_TABLE_ENTRIES`` int64 entries, default 2**20: 8 MiB; a Flux layer
of 4 x 8 GPUs uses about 10,000) is pinned by the first launch outside capture, since pinning is
not a capturable call; torch's capture wants warm-up runs first anyway.
"""
from __future__ import annotations

import os
from collections.abc import Callable

import torch

ENTRIES_ENV = "SWIFTFUSION_GRAPH_TABLE_ENTRIES"
DEFAULT_ENTRIES = 1 << 20


class PinnedArena:
    """``entries`` int64 of host memory from ``pin`` (``entries -> tensor``), handed out in
    slices that are never reused."""

    def __init__(self, entries: int, pin: Callable[[int], torch.Tensor]) -> None:
        self.memory = pin(entries)
        self.used = 0

    def take(self, rows: list[int]) -> torch.Tensor:
        """A fresh slice holding ``rows``."""
        n, size = len(rows), self.memory.numel()
        if self.used + n > size:
            raise RuntimeError(
                f"triton backend: the chunk tables of the launches captured in CUDA graphs fill "
                f"the pinned arena of {size} entries ({self.used} used, {n} more asked); set "
                f"{ENTRIES_ENV} to more entries before the first launch")
        out = self.memory[self.used:self.used + n]
        out.copy_(torch.tensor(rows, dtype=torch.int64))
        self.used += n
        return out


_arena: PinnedArena | None = None


def _pin(entries: int) -> torch.Tensor:
    return torch.empty(entries, dtype=torch.int64, pin_memory=True)


def _upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.to(device, non_blocking=True)


def device_table(rows: list[int], device: torch.device) -> torch.Tensor:
    """``rows`` as an int64 tensor on ``device`` (module docstring)."""
    global _arena
    if device.type != "cuda":
        return torch.tensor(rows, dtype=torch.int64)
    if not torch.cuda.is_current_stream_capturing():
        if _arena is None:
            _arena = PinnedArena(int(os.environ.get(ENTRIES_ENV, DEFAULT_ENTRIES)), _pin)
        return _upload(torch.tensor(rows, dtype=torch.int64), device)
    if _arena is None:
        raise RuntimeError("triton backend: a launch was captured in a CUDA graph before any "
                           "launch outside capture; run the captured code once first (a warm-up), "
                           "which pins the arena its chunk tables are copied from")
    return _upload(_arena.take(rows), device)
