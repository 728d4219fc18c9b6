"""NVSHMEM checks of the GPU suite, through the ``nvshmem`` communicator (nvshmem4py): init
from the torch process group (the unique id broadcast), symmetric tensors, put/get of slices
on the transfer streams, barriers and team calls, close (free) and a second communicator on the
same instance (one NVSHMEM instance per process, finalized at exit), the timeout path; the
smoke test the GPU command runs first (init, a round trip, close, finalize at exit); and a probe
of several PEs on one GPU (raw nvshmem4py, outside the communicator, which refuses two ranks on
one GPU), with and without CUDA MPS."""
from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from .report import RowWriter

SLEEP_CYCLES = 6_000_000_000  # torch.cuda._sleep: about 3 s at 2 GHz, past a 1 s timeout


def _make(timeout_s: float, kind: str = "nvshmem"):
    from ...comm import make_one_sided
    return make_one_sided(kind, rank=dist.get_rank(), world_size=dist.get_world_size(),
                          node_of=[0] * dist.get_world_size(), timeout_s=timeout_s)


def _device_of(comm) -> torch.device:
    """The communicator's GPU (nvshmem), else the CPU (the emulation's heap)."""
    return getattr(comm, "device", torch.device("cpu"))


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _roundtrip(comm) -> float:
    """Put slices (one contiguous, one strided on both sides) into symmetric memory and get
    them back, to this PE: max abs difference from what was sent (inf if anything is
    missing)."""
    me, device = dist.get_rank(), _device_of(comm)
    a = comm.symmetric_empty((4, 256), torch.float32)  # [rows, cols]
    b = comm.symmetric_empty((4, 256), torch.float32)
    src = torch.randn(4, 256, device=device)
    a.copy_(src)
    b.fill_(float("nan"))
    comm.put(b[1:3], src[1:3], me, queue="ring", what="suite put rows").wait()
    comm.put(b[:, 64:128], src.t().contiguous().t()[:, 64:128], me, queue="other",
             what="suite put strided").wait()
    back = torch.full((4, 256), float("nan"), device=device)
    comm.get(back[1:3], b[1:3], me, queue="ring", what="suite get rows").wait()
    comm.get(back[:, 64:128], a[:, 64:128], me, queue="other", what="suite get strided").wait()
    comm.barrier_all(what="suite barrier")
    _synchronize(back.device)
    sent = torch.cat([src[1:3].flatten(), src[:, 64:128].flatten()])
    got = torch.cat([back[1:3].flatten(), back[:, 64:128].flatten()])
    return (got - sent).abs().max().item() if torch.isfinite(got).all() else float("inf")


def lifecycle(w: RowWriter, kind: str = "nvshmem") -> None:
    """Init, transfers, barriers, team calls, close, a second communicator (this process's
    world), on the one-sided backend ``kind``. With ``nvshmem`` the second communicator joins
    the process's NVSHMEM instance: no second init (NVSHMEM is finalized once, at exit)."""
    t0 = time.perf_counter()
    comm = _make(30.0, kind)
    version = kind
    if kind == "nvshmem":
        from ...comm.nvshmem import nvshmem_modules
        version = f"libnvshmem {nvshmem_modules()[0].get_version().libnvshmem_version}"
    w.add("init from the process group", "PASS", f"{version}, {dist.get_world_size()} PE, "
          f"{time.perf_counter() - t0:.1f} s", world=dist.get_world_size())
    try:
        err = _roundtrip(comm)
        w.check("put/get slices on stream", err == 0.0, f"max abs diff {err:g} (contiguous and "
                "strided, both queues)", err=err)
        group = tuple(range(dist.get_world_size()))
        comm.prepare_groups([group])
        comm.barrier(group, what="suite team barrier")
        comm.sync(group, what="suite team sync")
        _synchronize(_device_of(comm))
        w.add("team split, barrier, sync", "PASS", f"team over ranks {group}")
        heap = comm.symmetric_heap_bytes()
    finally:
        comm.close()
    w.add("close (free buffers and teams)", "PASS", f"{heap} bytes freed")
    comm = _make(30.0, kind)  # the process's instance, initialised once
    try:
        err = _roundtrip(comm)
        w.check("a second communicator after close", err == 0.0, f"round trip max abs diff {err:g}"
                + (" (the same NVSHMEM instance)" if kind == "nvshmem" else ""))
    finally:
        comm.close()


def smoke(w: RowWriter) -> bool:
    """The GPU command's first check (this process's one-rank world): nvshmem4py imports,
    NVSHMEM initialises, a round trip of slices is exact, the communicator closes; NVSHMEM is
    then finalized when the process exits. Returns whether all of that held."""
    from ...comm.nvshmem import nvshmem_import_error
    error = nvshmem_import_error()
    if error is not None:
        w.add("import nvshmem.core", "FAIL", error[:300])
        return False
    comm = _make(30.0)
    try:
        err = _roundtrip(comm)
    finally:
        comm.close()
    w.check("init, round trip, close", err == 0.0, f"max abs diff {err:g}; NVSHMEM is finalized "
            "at exit", err=err)
    return err == 0.0


def timeout_path(w: RowWriter) -> None:
    """A transfer queued behind a 3 s kernel, with a 1 s timeout: the next call raises
    ``CommTimeout`` naming rank, peer and stage within about a second, and close returns
    without a collective. NVSHMEM is unusable in this process afterwards (run it last)."""
    from ...comm import CommTimeout
    comm = _make(1.0)
    comm.abort_after_s = 60.0
    me = dist.get_rank()
    buf = comm.symmetric_empty((1024,), torch.float32)
    src = torch.ones(1024, device=comm.device)
    torch.cuda._sleep(SLEEP_CYCLES)  # the current stream is busy; the put waits behind it
    t0 = time.perf_counter()
    comm.put(buf, src, me, queue="ring", what="suite stuck put")
    raised = None
    while time.perf_counter() - t0 < 10.0 and raised is None:
        try:
            comm.barrier_all(what="suite barrier after the stuck put")
        except CommTimeout as exc:
            raised = exc
        time.sleep(0.05)
    seconds = time.perf_counter() - t0
    t1 = time.perf_counter()
    comm.close()
    closed = time.perf_counter() - t1
    text = str(raised) if raised else ""
    named = all(s in text for s in (f"rank {me}", f"peer {me}", "suite stuck put"))
    w.check("timeout returns", raised is not None and named and seconds < 5.0,
            f"CommTimeout after {seconds:.1f} s, close {closed:.2f} s: {text[:160]}",
            seconds=seconds, close_s=closed, message=text)
    torch.cuda.synchronize()  # the sleep kernel ends; nothing else is queued


# ---------------------------------------------------------------------------------------
# Several PEs on one GPU (raw nvshmem4py; run as separate processes by the suite).

def pe_probe(rank: int, world: int, port: int) -> dict:
    """One PE of ``world`` on GPU 0: uid broadcast over gloo, init, a symmetric tensor, a put
    of my rank to the next PE, a barrier; returns what was received or the error."""
    from ...comm.nvshmem import _cuda_core_device, broadcast_unique_id, nvshmem_modules
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    torch.cuda.set_device(0)
    core, bindings = nvshmem_modules()
    uid = broadcast_unique_id(rank)
    core.init(device=_cuda_core_device(0), uid=uid, rank=rank, nranks=world,
              initializer_method="uid")
    try:
        t = core.tensor((256,), dtype=torch.float32)
        t.fill_(-1.0)
        src = torch.full((256,), float(rank), device="cuda")
        stream = torch.cuda.current_stream()
        bindings.barrier_all_on_stream(stream.cuda_stream)  # every PE's tensor is filled
        peer = (rank + 1) % world
        bindings.putmem_on_stream(t.data_ptr(), src.data_ptr(), src.numel() * 4, peer, stream.cuda_stream)
        bindings.barrier_all_on_stream(stream.cuda_stream)
        torch.cuda.synchronize()
        got = t[0].item()
        core.free_tensor(t)
    finally:
        core.finalize()
    dist.destroy_process_group()
    return {"received": got, "expected": float((rank - 1) % world)}


def mps_available() -> str | None:
    """The path of ``nvidia-cuda-mps-control``, or None."""
    import shutil
    return shutil.which("nvidia-cuda-mps-control")


def mps_env(root: str) -> dict[str, str]:
    """Client and daemon variables of a private MPS instance under ``root``."""
    return {"CUDA_MPS_PIPE_DIRECTORY": os.path.join(root, "pipe"),
            "CUDA_MPS_LOG_DIRECTORY": os.path.join(root, "log")}
