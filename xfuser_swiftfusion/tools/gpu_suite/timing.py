"""Timing for the GPU suite's speed and replay stages.

* ``call_ms``: median milliseconds of one call as a caller sees it back to back (CUDA:
  ``triton.testing.do_bench``, events around repeated calls, so a call whose host work
  exceeds its GPU work measures the host);
* ``kernel_ms``: median GPU milliseconds of the work a call queues, without host gaps (CUDA:
  ``triton.testing.do_bench_cudagraph``, the calls captured in a CUDA graph and replayed;
  where the call cannot be captured, the events of ``call_ms``, and the method says so);
* ``host_and_gpu_ms``: host issue time and GPU time of the same calls, from one run: a
  ``torch.cuda._sleep`` kernel keeps the GPU busy while the host issues the calls, so the
  events recorded after it measure the GPU's work back to back (valid only where the host
  finished issuing before the sleep ended, which is checked and raised otherwise).

On CPU (``--allow-cpu`` stand-ins) every figure is host wall-clock time (``perf_counter``):
CPU work is synchronous, so there is no host/GPU split there.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

SLEEP_CYCLES_PER_MS = 2_000_000  # torch.cuda._sleep: about 1 ms at 2 GHz


def _cpu_ms(fn: Callable[[], object], reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def call_ms(fn: Callable[[], object], device: torch.device, quick: bool = False) -> float:
    """Median milliseconds per call, back to back (see the module docstring)."""
    if device.type != "cuda":
        return _cpu_ms(fn, 3 if quick else 5)
    from triton.testing import do_bench
    return do_bench(fn, warmup=10 if quick else 25, rep=40 if quick else 100, return_mode="median")


def kernel_ms(fn: Callable[[], object], device: torch.device, quick: bool = False) -> tuple[float, str]:
    """(median GPU milliseconds per call without host gaps, method: ``"graph"``, ``"events"``
    where capture failed (with the reason), ``"host"`` on CPU)."""
    if device.type != "cuda":
        return _cpu_ms(fn, 3 if quick else 5), "host"
    from triton.testing import do_bench_cudagraph
    try:
        return do_bench_cudagraph(fn, rep=20 if quick else 50, return_mode="median"), "graph"
    except Exception as exc:  # noqa: BLE001  (a call that cannot be captured is timed with events)
        torch.cuda.synchronize()
        return call_ms(fn, device, quick), f"events (capture failed: {type(exc).__name__}: {exc})"[:200]


class HostWaits(RuntimeError):
    """The call blocks the host until the GPU catches up (a synchronizing call inside it): its
    host and GPU times cannot be told apart."""


def host_and_gpu_ms(fn: Callable[[], object], device: torch.device, reps: int = 5) -> tuple[float, float]:
    """(median host milliseconds to issue one call, median GPU milliseconds of its work);
    ``HostWaits`` where the call waits for the GPU."""
    if device.type != "cuda":
        ms = _cpu_ms(fn, reps)
        return ms, ms
    fn()  # warm-up: compiles, allocations, caches
    torch.cuda.synchronize()
    host, gpu = [], []
    sleep_ms, behind = 50.0, None  # behind: the issue time of a run that outlasted its sleep
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(int(sleep_ms * SLEEP_CYCLES_PER_MS))
        start.record()
        t0 = time.perf_counter()
        fn()
        issued = (time.perf_counter() - t0) * 1e3
        end.record()
        ahead = not start.query()  # the sleep still runs: the GPU did not wait for the host
        torch.cuda.synchronize()
        if not ahead:
            # a slow host and a call that waits for the GPU both outlast the sleep; only the
            # second still does with a sleep twice as long as the host needed before
            if behind is not None and sleep_ms >= 2 * behind and issued >= 0.8 * sleep_ms:
                raise HostWaits(f"the call kept the host {issued:.0f} ms behind a {sleep_ms:.0f} ms "
                                f"sleep kernel ({behind:.0f} ms behind a shorter one): it waits "
                                "for the GPU (a synchronizing call inside, or more kernel launches "
                                "than the GPU's launch queue holds while it sleeps)")
            behind = issued
            sleep_ms = max(sleep_ms * 4, issued * 2)
            if sleep_ms > 10_000:
                raise RuntimeError(f"the host took {issued:.0f} ms to issue one call: longer than "
                                   "any sleep kernel this check uses")
            continue
        host.append(issued)
        gpu.append(start.elapsed_time(end))
    if not host:
        raise RuntimeError("no run had the GPU busy while the host issued the call")
    return statistics.median(host), statistics.median(gpu)
