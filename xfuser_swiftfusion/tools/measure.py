"""Peak memory of one rank over an interval: CUDA's allocator peak, or on CPU the resident
set size sampled by a thread (``psutil``)."""
from __future__ import annotations

import threading

import psutil
import torch


class PeakMemory:
    """Peak memory of this rank between ``start()`` and ``stop()`` (bytes).

    CUDA: ``torch.cuda.max_memory_allocated`` after a reset. CPU: resident set size sampled
    every ``interval_s`` by a daemon thread (includes weights and the interpreter).
    """

    def __init__(self, interval_s: float = 0.002) -> None:
        self.interval_s = interval_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def _rss() -> int:
        return psutil.Process().memory_info().rss

    def start(self) -> "PeakMemory":
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
            return self
        self.peak = self._rss()
        self._stop.clear()

        def sample() -> None:
            while not self._stop.wait(self.interval_s):
                self.peak = max(self.peak, self._rss())

        self._thread = threading.Thread(target=sample, daemon=True, name="peak-rss")
        self._thread.start()
        return self

    def stop(self) -> int:
        if torch.cuda.is_available():
            self.peak = torch.cuda.max_memory_allocated()
            return self.peak
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
        self.peak = max(self.peak, self._rss())
        return self.peak


__all__ = ["PeakMemory"]
