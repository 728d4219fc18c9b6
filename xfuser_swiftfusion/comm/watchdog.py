"""A host thread that bounds asynchronous GPU work by a timeout without blocking the caller.

Waits on CUDA order streams and return at once (an NVSHMEM event, an NCCL work's end event);
what then bounds them is this thread. It polls each watched step's ``done()`` (a CUDA event's
``query``, a work's ``is_completed``); one not done ``timeout_s`` after it was issued fails its
communicator (``fail(exc)``: the next call into it raises ``CommTimeout`` naming rank, peer and
stage), and if the communicator is not closed within ``abort_after_s()`` after that (its host
thread may be blocked in a CUDA call behind the stuck kernel), the process ends (``abort``),
since kernels waiting on a peer cannot be cancelled.

Nothing recorded inside a CUDA graph capture may be watched (an event of a capture cannot be
queried): communicators stop watching while capturing and watch one event per replay instead.
"""
from __future__ import annotations

import collections
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from .errors import CommTimeout, PeerFailure


def abort_process(message: str) -> None:
    """End the process: its stuck kernels cannot be cancelled and its host thread does not come
    back to see the failure."""
    print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)


@dataclass
class Watched:
    done: Callable[[], bool]  # a CUDA event's query, a work's is_completed, or a host flag
    deadline: float
    doing: str
    what: str


class Watchdog:
    """One thread per communicator (module docstring). ``rank``, ``timeout_s``: the
    communicator's; ``device``: the CUDA device whose events it queries (None: no CUDA);
    ``stuck``: what the failure says cannot be undone (e.g. "NVSHMEM kernels on cuda:0 cannot be
    cancelled"); ``fail(exc)``: records the failure; ``abort_after_s()``: grace before ``abort``;
    ``log``: where the failure is logged."""

    def __init__(self, name: str, *, rank: int, timeout_s: float, device: int | None, stuck: str,
                 fail: Callable[[BaseException], None], abort_after_s: Callable[[], float],
                 abort: Callable[[str], None], log: logging.Logger) -> None:
        self.rank, self.timeout_s, self.device, self.stuck = rank, timeout_s, device, stuck
        self._fail, self._abort_after_s, self._abort, self._log = fail, abort_after_s, abort, log
        self._incoming: collections.deque[Watched] = collections.deque()
        self._pending: list[Watched] = []
        self._stop = threading.Event()
        self._poll_s = min(0.05, max(timeout_s / 10, 1e-3))
        self._thread = threading.Thread(target=self._run, daemon=True, name=name)
        self._thread.start()

    def watch(self, done: Callable[[], bool], doing: str, what: str) -> None:
        """Fail the communicator unless ``done()`` within ``timeout_s`` from now."""
        self._incoming.append(Watched(done, time.monotonic() + self.timeout_s, doing, what))

    def oldest_pending(self) -> Watched | None:
        """The oldest watched step not complete."""
        return next((w for w in (*self._pending, *self._incoming) if not w.done()), None)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)

    def _run(self) -> None:
        if self.device is not None:  # event queries from this thread must not create a context on GPU 0
            torch.cuda.set_device(self.device)
        exc: BaseException | None = None
        where = "" if self.device is None else f" on cuda:{self.device}"
        while exc is None and not self._stop.wait(self._poll_s):
            while self._incoming:
                self._pending.append(self._incoming.popleft())
            try:
                self._pending = [w for w in self._pending if not w.done()]
            except Exception as err:  # an asynchronous CUDA error: the device is unusable
                exc = PeerFailure(f"rank {self.rank}: CUDA error while transfers were in flight"
                                  f"{where}: {err}")
                break
            now = time.monotonic()
            late = next((w for w in self._pending if w.deadline < now), None)
            if late is not None:
                exc = CommTimeout(
                    f"rank {self.rank}: {late.what!r}: {late.doing} did not complete within "
                    f"{self.timeout_s:.1f} s (a peer is gone or stuck; {self.stuck})")
        if exc is None:
            return
        self._fail(exc)
        self._log.error("%s", exc)
        grace = self._abort_after_s()
        if not self._stop.wait(grace):
            self._abort(f"xfuser_swiftfusion: {exc}; the communicator was not closed within "
                        f"{grace:.1f} s after that: ending the process")


__all__ = ["Watchdog", "Watched", "abort_process"]
