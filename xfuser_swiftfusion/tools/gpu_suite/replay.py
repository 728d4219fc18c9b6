"""The replay stage: one rank's whole ``swiftfusion`` layer of a 4 x 8 cluster on one GPU.

One GPU cannot run 32 ranks, but it can run rank 0's part of a layer exactly as the strategy
makes it: ``TorusAttention`` over ``OneSidedTorusIO`` (every stage of ``torus_schedule``, every
``attend`` launch and state merge, every finalize), with ``ReplayComm`` as the one-sided
communicator: each put or get to any peer becomes a device-to-device copy of the same bytes,
issued as the NVSHMEM communicator issues its transfers (on a pool stream of the transfer's
queue, after the caller's stream; one copy per contiguous run of the symmetric side, where
NVSHMEM makes one ``put/getmem_on_stream`` call), and barriers order the streams as NVSHMEM's
do, with no peer to wait for. What it measures is therefore the layer's compute and host work
(the copies run at device-memory speed, far above any link), for Flux 3072 / 4096 px and
CogVideoX 5B on 4 x 8 GPUs (``kernel.MODELS``; CPU stand-ins with ``--allow-cpu``):

* per backend of ``attend`` (triton, cudnn, torch flash, flash-attn where installed): the GPU
  time per layer and the host (Python) time to issue it (``timing.host_and_gpu_ms``); where
  the host time exceeds the GPU time the layer is host-bound on a real cluster too (its
  compute is the same there), and the row says so;
* the same layer captured in a CUDA graph and replayed (``torch.cuda.graph``), where the
  layer's calls allow capture (the row names the call that does not), its replayed output
  checked against the eager layer's from the same state (``same_output``; a FAIL beyond
  ``GRAPH_TOLERANCE``); where the host cannot run ahead of the GPU (``HostWaits``), the
  replay's time is the layer's GPU time;
* xFuser's USP-equivalent: one attention kernel over the same tokens (the rank's ``L / R``
  queries of its ``H / P_u`` heads, text included, against all keys), cuDNN as xFuser runs it
  on Hopper and torch's flash attention: the compute floor the layer's chunked launches and
  merges are compared with.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ...comm.base import Handle, OneSided, SymmetricBuffers
from ...comm.nvshmem import STREAMS_PER_QUEUE, contiguous_runs
from ...kernels import attend_calls
from .kernel import LABELS, ModelShape, backend, models, runnable
from .report import RowWriter
from .timing import HostWaits, call_ms, host_and_gpu_ms, kernel_ms


class _Done(Handle):
    """A CPU copy: complete when issued."""

    def wait(self) -> None:
        pass


class _EventDone(Handle):
    """A copy on a pool stream: ``wait`` orders the caller's current stream after it."""

    def __init__(self, event: torch.cuda.Event) -> None:
        self.event = event

    def wait(self) -> None:
        torch.cuda.current_stream().wait_event(self.event)


@dataclass(eq=False)
class ReplayComm(OneSided):
    """One rank of a world that is not there (see the module docstring): symmetric buffers are
    device tensors of this rank, filled with random values (no peer writes them); ``put`` and
    ``get`` with any peer copy between this rank's own buffers; byte counts as the real
    transfers'. ``copies``: device-to-device copies issued."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    copies: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        self._buffers = SymmetricBuffers()
        self._heap_bytes = 0
        self._cuda = self.device.type == "cuda"
        self._gen = generator(self.device)
        if self._cuda:
            self._pools = {q: [torch.cuda.Stream(device=self.device) for _ in range(STREAMS_PER_QUEUE)]
                           for q in ("ring", "other")}
            self._turn = dict.fromkeys(self._pools, 0)
            self._used: dict[int, torch.cuda.Stream] = {}

    def symmetric_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype, device=self.device)
        if dtype.is_floating_point:
            t.normal_(generator=self._gen)
        else:
            t.zero_()
        self._buffers.add(t, t)
        self._heap_bytes += t.numel() * t.element_size()
        return t

    def symmetric_heap_bytes(self) -> int:
        return self._heap_bytes

    def put(self, dst: torch.Tensor, src: torch.Tensor, peer: int, *, queue: str, what: str) -> Handle:
        return self._transfer("put", dst, src, peer, queue)

    def get(self, dst: torch.Tensor, src: torch.Tensor, peer: int, *, queue: str, what: str) -> Handle:
        return self._transfer("get", src, dst, peer, queue)

    def _transfer(self, op: str, sym: torch.Tensor, local: torch.Tensor, peer: int, queue: str) -> Handle:
        self.check_transfer(sym, local, peer, queue)
        self._buffers.lookup(sym)
        self.counter.count(peer, sym.numel() * sym.element_size())
        if not self._cuda:
            self._copy_runs(op, sym, local)
            return _Done()
        pool = self._pools[queue]
        stream = pool[self._turn[queue]]
        self._turn[queue] = (self._turn[queue] + 1) % len(pool)
        self._used[id(stream)] = stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._copy_runs(op, sym, local)
            event = torch.cuda.Event()
            event.record(stream)
        local.record_stream(stream)
        return _EventDone(event)

    def _copy_runs(self, op: str, sym: torch.Tensor, local: torch.Tensor) -> None:
        """One copy per contiguous byte run of ``sym`` (a local side that is not contiguous is
        staged through a contiguous temporary, as the NVSHMEM communicator does)."""
        staged = local if local.is_contiguous() else (
            local.contiguous() if op == "put" else torch.empty(local.shape, dtype=local.dtype,
                                                               device=local.device))
        far = _bytes(sym.untyped_storage(), sym.device)
        near = staged.reshape(-1).view(torch.uint8)
        base, pos = sym.storage_offset() * sym.element_size(), 0
        for off, n in contiguous_runs(sym):
            a, b = far[base + off:base + off + n], near[pos:pos + n]
            (a.copy_(b) if op == "put" else b.copy_(a))
            self.copies += 1
            pos += n
        if staged is not local and op == "get":
            local.copy_(staged)

    def _order_after_transfers(self) -> None:
        if self._cuda:
            current = torch.cuda.current_stream()
            for s in self._used.values():
                current.wait_stream(s)
            self._used.clear()
        self.counter.barriers += 1

    def barrier_all(self, *, what: str) -> None:
        self._order_after_transfers()

    def barrier(self, ranks: tuple[int, ...], *, what: str) -> None:
        self._order_after_transfers()

    def sync(self, ranks: tuple[int, ...], *, what: str) -> None:
        self.counter.barriers += 1  # the transfers it orders were waited for already

    def close(self) -> None:
        self._buffers.clear()


def generator(device: torch.device, seed: int = 0) -> torch.Generator:
    """A generator of the replay's own: a CUDA graph capture that fails leaves the device's
    default generator unusable ('Offset increment outside graph capture'), and the rows after
    it still draw inputs."""
    return torch.Generator(device=device).manual_seed(seed)


def _bytes(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """A flat uint8 tensor over ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


@dataclass
class ReplayLayer:
    """Rank 0's ``swiftfusion`` layer of ``model`` on ``nodes`` x ``gpus`` with its inputs."""

    model: ModelShape
    layer: object
    comm: ReplayComm
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    joint: object
    scale: float
    mesh: object
    usp_heads: int
    usp_queries: int
    keys: int

    def __call__(self) -> torch.Tensor:
        return self.layer(self.q, self.k, self.v, self.joint, self.scale)


def build_layer(model: ModelShape, device: torch.device, dtype: torch.dtype = torch.bfloat16,
                nodes: int = 4, gpus: int = 8) -> ReplayLayer:
    """Rank 0's layer: the mesh and head count ``init_sequence_parallel`` would choose, its
    groups, ``OneSidedTorusIO`` over a ``ReplayComm``, random inputs ``[1, H, S, D]`` (S =
    ceil(image tokens / W)) and text tokens as joint tensors where the model passes them so."""
    from ...groups import SPGroups
    from ...mesh import choose_mesh, torus_mesh
    from ...strategies.layout import Joint
    from ...strategies.swiftfusion import SPEC, OneSidedTorusIO
    from ...strategies.torus import TorusAttention
    from ...topology import Topology
    topo = Topology(nodes, gpus)
    mesh, heads = torus_mesh(topo, model.heads)
    if heads != model.heads:
        raise ValueError(f"{model.name}: {model.heads} heads need padding to {heads} on {topo}; "
                         "the replay runs unpadded models only")
    W = topo.world_size
    comm = ReplayComm(0, W, [topo.node_of(r) for r in range(W)], 60.0, device=device)
    io = OneSidedTorusIO(SPGroups(mesh, 0), comm, 0)
    layer = TorusAttention(SPEC, mesh, io, 0, [comm])
    S, D = -(-(model.tokens - model.joint) // W), model.head_dim
    gen = generator(device)
    make = lambda n: torch.randn(1, heads, n, D, device=device, generator=gen).to(dtype)  # noqa: E731
    joint = Joint(make(model.joint), make(model.joint), make(model.joint), "front") if model.joint else None
    usp = choose_mesh(topo, model.heads, "usp")  # xFuser's USP: Ulysses x Ring degrees
    return ReplayLayer(model, layer, comm, make(S), make(S), make(S), joint, D ** -0.5, mesh,
                       model.heads // usp.ulysses, S * W // usp.ring + model.joint, S * W + model.joint)


def usp_single_kernel(r: ReplayLayer, name: str):
    """One attention call over the USP-equivalent tokens (``r.usp_queries`` queries of
    ``r.usp_heads`` heads against ``r.keys`` keys) with backend ``name``'s op."""
    from ...kernels import torch_cuda
    D, device = r.model.head_dim, r.q.device
    gen = generator(device, 1)
    q, k, v = (torch.randn(1, r.usp_heads, n, D, device=device, generator=gen).to(r.q.dtype)
               for n in (r.usp_queries, r.keys, r.keys))
    if name == "cpu":
        op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        return lambda: op(q, k, v, scale=r.scale)
    op = torch_cuda.cudnn_op if name == "cudnn" else torch_cuda.flash_op
    return lambda: op(q, k, v, r.scale)


GRAPH_TOLERANCE = 2e-2  # bf16: a replay computes what the eager layer does


def same_output(r: ReplayLayer, first: Callable[[], torch.Tensor],
                second: Callable[[], torch.Tensor]) -> float:
    """Max abs difference between the outputs of ``first()`` and ``second()``, each run from
    the symmetric buffers as they are now: what its transfers leave in them is the only state
    the layer carries from call to call."""
    saved = [(t, t.clone()) for t in r.comm._buffers.entries()]
    a = first().clone()
    for t, before in saved:
        t.copy_(before)
    return (a.float() - second().float()).abs().max().item()


def _graph_ms(r: ReplayLayer, quick: bool) -> tuple[float | None, str, float | None]:
    """(median milliseconds per replay of the layer captured in a CUDA graph, or None; what
    happened: the first error raised inside the capture, not the one ending the capture then
    raises, e.g. 'capturing stream has unjoined work' for the transfers left mid-layer; the
    max abs difference of a replay's output from the eager layer's, or None)."""
    inside: list[BaseException] = []
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the default stream, as capture wants
            r()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            try:
                out = r()
            except BaseException as exc:
                inside.append(exc)
                raise
    except Exception as exc:  # noqa: BLE001  (what cannot be captured is the finding)
        torch.cuda.synchronize()
        first = inside[0] if inside else exc
        return None, f"capture failed: {_first_line(first)}"[:300], None

    def replayed() -> torch.Tensor:
        graph.replay()
        return out

    diff = same_output(r, r, replayed)
    return call_ms(graph.replay, r.q.device, quick), "captured", diff


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def _one_layer(r: ReplayLayer) -> dict[str, int]:
    """Run the layer once: its attend calls, copies and transfer bytes."""
    calls0, copies0 = attend_calls(), r.comm.copies
    r.comm.counter.reset()
    r()
    return {"attend_calls": attend_calls() - calls0, "copies": r.comm.copies - copies0,
            "inter_node_bytes": r.comm.counter.inter_node_bytes,
            "intra_node_bytes": r.comm.counter.intra_node_bytes}


def _label(name: str) -> str:
    return LABELS.get(name, name)


def replay(w: RowWriter, device: torch.device, quick: bool = False) -> None:
    """The replay stage (see the module docstring): per model, a row per backend and one for
    the USP-equivalent single kernel."""
    cuda = device.type == "cuda"
    dtype = torch.bfloat16
    for model in models(device):
        r = build_layer(model, device, dtype)
        names = runnable(None, device, model.head_dim, dtype)
        T, U, R = r.mesh.torus, r.mesh.ulysses_intra, r.mesh.ring
        where = f"{model.name} rank 0 of 4x8 ({r.mesh.describe()})"
        layer_gpu: dict[str, float] = {}
        for name in names:
            waits = host = gpu = None
            try:
                with backend(name):
                    per_layer = _one_layer(r)
                    try:
                        host, gpu = host_and_gpu_ms(r, device, 3 if quick else 5)
                    except HostWaits as exc:  # a finding: the host cannot run ahead of the GPU
                        waits, wall = exc, call_ms(r, device, quick)
                    graph_ms, graph_how, diff = (_graph_ms(r, quick) if cuda
                                                 else (None, "CPU: no CUDA graphs", None))
            except Exception as exc:  # noqa: BLE001  (one backend's error costs its row only)
                w.add(f"{where}: {_label(name)}", "FAIL", f"{type(exc).__name__}: {exc}"[:400])
                continue
            if waits is not None:
                timing = f"{wall:.2f} ms per layer (wall); {waits}"
                gpu = graph_ms  # the GPU's time for the layer: its replay, without the host
            elif cuda:
                bound = ("host-bound: the host issues the layer slower than the GPU runs it"
                         if host > gpu else "GPU-bound")
                timing = f"GPU {gpu:.2f} ms, host {host:.2f} ms per layer: {bound}"
            else:
                timing = f"{gpu:.2f} ms per layer (CPU stand-in: host and compute are one)"
            if gpu is not None:
                layer_gpu[name] = gpu
            graph = graph_how
            if graph_ms is not None:
                graph = (f"CUDA graph {graph_ms:.2f} ms, its output "
                         + ("equals" if diff <= GRAPH_TOLERANCE else "DIFFERS FROM")
                         + f" the eager layer's (max diff {diff:.1e})")
            w.add(f"{where}: {_label(name)}",
                  "FAIL" if diff is not None and not diff <= GRAPH_TOLERANCE else "INFO",
                  f"{timing}; {graph}; "
                  f"{per_layer['attend_calls']} attend calls, {per_layer['copies']} copies for "
                  f"{(per_layer['inter_node_bytes'] + per_layer['intra_node_bytes']) / 2**20:.1f} MiB "
                  "of transfers", backend=name, gpu_ms=gpu, host_ms=host,
                  host_bound=None if host is None else host > gpu, host_waits=waits is not None,
                  wall_ms=wall if waits is not None else None, graph_ms=graph_ms, graph=graph_how,
                  graph_diff=diff, mesh=r.mesh.describe(), T=T, U=U, R=R, stand_in=not cuda,
                  **per_layer)
        single = {}
        for name in [n for n in ("cudnn", "torch", "cpu") if n in names]:
            try:
                single[name] = kernel_ms(usp_single_kernel(r, name), device, quick)[0]
            except Exception as exc:  # noqa: BLE001
                w.add(f"{where}: USP-equivalent single kernel, {_label(name)}", "FAIL",
                      f"{type(exc).__name__}: {exc}"[:400])
        if single and layer_gpu:
            best = min(layer_gpu, key=layer_gpu.get)
            floor = min(single.values())
            flops = 4.0 * r.usp_heads * r.usp_queries * r.keys * model.head_dim
            w.add(f"{where}: USP-equivalent single kernel", "INFO",
                  ", ".join(f"{_label(n)} {ms:.2f} ms ({flops / (ms * 1e-3) / 1e12:.0f} TFLOP/s)"
                            for n, ms in single.items())
                  + f" for {r.usp_heads} heads x {r.usp_queries} queries x {r.keys} keys; "
                  f"best layer ({_label(best)}) {layer_gpu[best]:.2f} ms = "
                  f"{layer_gpu[best] / floor:.2f}x the single kernel",
                  single_ms=single, best_layer=best, layer_gpu_ms=layer_gpu, flops=flops,
                  ratio=layer_gpu[best] / floor, stand_in=not cuda)
        r.comm.close()
        del r
        if cuda:
            torch.cuda.empty_cache()


__all__ = ["ReplayComm", "ReplayLayer", "build_layer", "replay", "usp_single_kernel"]
