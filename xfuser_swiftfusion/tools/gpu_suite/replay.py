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

* xFuser's USP on the same rank (``usp_layer.py``: Ulysses inside, ring across, one attention
  call with log-sum-exp per ring block and torch's merge, its all-to-alls as device copies):
  the row every other row is read against (``usp_gpu_ms`` in each row's data);
* per backend of ``attend`` (triton, cudnn, torch flash, flash-attn where installed) and
  variant (``VARIANTS``): the layer's calls made directly at every call as before execution
  plans (``direct``, one launch per ring step), and as plans (``plan.py``) with one launch per
  ring step, with one launch per Torus stage and query entry (``plan``), and replayed as the
  plan's CUDA graph (``plan + CUDA graph``, the default on CUDA): the GPU time per layer and
  the host (Python) time to issue it (``timing.host_and_gpu_ms``; where the host time exceeds
  the GPU time the layer is host-bound on a real cluster too), the attention kernel launches
  (the profiler's), the attend calls; a graph row's replayed output is checked against the
  eager plan's from the same state (``same_output``; a FAIL beyond ``GRAPH_TOLERANCE``) and its
  back-to-back wall time set beside its GPU time; the ``direct`` row also captures the whole
  call in a CUDA graph where its calls allow (the row names the call that does not);
* SGLang's pipelined Ulysses (``sglang_ulysses.py``: ``USPAttention._pipelined_ulysses``, the
  head-group exchange over its copy-engine transport) on rank 0 of one machine of the cluster,
  the model's whole sequence over its GPUs: SGLang pipelines only there (ring 1, every Ulysses
  rank on one host), so it is a row of its own, not read against USP's;
* xFuser's USP-equivalent: one attention kernel over the same tokens (the rank's ``L / R``
  queries of its ``H / P_u`` heads, text included, against all keys), cuDNN as xFuser runs it
  on Hopper and torch's flash attention: the compute floor.
"""
from __future__ import annotations

import contextlib

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ...comm.base import Handle, OneSided, SymmetricBuffers
from ...comm.nvshmem import STREAMS_PER_QUEUE, contiguous_runs
from ...kernels import attend_calls
from .kernel import LABELS, ModelShape, backend, models, runnable
from .report import RowWriter
from .timing import HostWaits, call_ms, host_and_gpu_ms, kernel_ms
from .sglang_ulysses import PipelinedUlysses, build_pipelined_ulysses, groups_for
from .usp_layer import UspLayer, build_usp


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
    device tensors of this rank, filled with random values (no peer writes them); a ``get``
    from any peer copies from this rank's own buffer, a ``put`` to another peer into a scratch
    image of the buffer that nothing reads (puts to several peers would otherwise land in one
    local slot, concurrently on pool streams: a race no real cluster has); byte counts as the
    real transfers'. ``copies``: device-to-device copies issued (a CUDA graph replay of a plan
    adds what its capture issued, as it adds bytes: ``replay_counts``)."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    copies: int = field(default=0, init=False)
    replay_counts = ("copies",)

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
        self._buffers.add(t, (t, torch.empty_like(t)))  # (buffer, the scratch image remote puts land in)
        self._heap_bytes += t.numel() * t.element_size()
        return t

    def symmetric_heap_bytes(self) -> int:
        return self._heap_bytes

    def prepare(self, op: str, dst: torch.Tensor, src: torch.Tensor, peer: int, *, queue: str,
                what: str) -> Callable[[], Handle]:
        sym, local = (dst, src) if op == "put" else (src, dst)
        self.check_transfer(sym, local, peer, queue)
        if op == "put" and peer != self.rank:  # the same view of the scratch image
            sym = _same_view(self._buffers.lookup(sym)[1], sym)
        else:
            self._buffers.lookup(sym)
        nbytes = sym.numel() * sym.element_size()
        staged = local if local.is_contiguous() else torch.empty(local.shape, dtype=local.dtype,
                                                                 device=local.device)
        # one copy per contiguous byte run of the symmetric side, as NVSHMEM makes one call
        far = _bytes(sym.untyped_storage(), sym.device)
        near = staged.reshape(-1).view(torch.uint8)
        base, pos, runs = sym.storage_offset() * sym.element_size(), 0, []
        for off, n in contiguous_runs(sym):
            a, b = far[base + off:base + off + n], near[pos:pos + n]
            runs.append((a, b) if op == "put" else (b, a))
            pos += n
        stage_in, stage_out = staged is not local and op == "put", staged is not local and op == "get"

        def copy() -> None:
            if stage_in:
                staged.copy_(local)
            for to, frm in runs:
                to.copy_(frm)
            if stage_out:
                local.copy_(staged)
            self.copies += len(runs)

        if not self._cuda:
            def issue() -> Handle:
                self.counter.count(peer, nbytes)
                copy()
                return _Done()
            return issue
        pool = self._pools[queue]
        stream = pool[self._turn[queue]]
        self._turn[queue] = (self._turn[queue] + 1) % len(pool)

        def issue_cuda() -> Handle:
            self.counter.count(peer, nbytes)
            self._used[id(stream)] = stream
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                copy()
                event = torch.cuda.Event()
                event.record(stream)
            local.record_stream(stream)
            return _EventDone(event)

        return issue_cuda

    def prepare_barrier(self, ranks: tuple[int, ...] | None, *, what: str,
                        quiet: bool = True) -> Callable[[], None]:
        """A barrier orders the current stream after the transfers issued since the last one;
        a sync has nothing to order (the transfers it orders were waited for already)."""
        def barrier() -> None:
            if quiet and self._cuda:
                current = torch.cuda.current_stream()
                for s in self._used.values():
                    current.wait_stream(s)
                self._used.clear()
            self.counter.barriers += 1

        return barrier

    def close(self) -> None:
        self._buffers.clear()


def _same_view(image: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
    """The view of ``image`` (a buffer of the same shape as ``view``'s base) that ``view`` is of
    its own buffer: same storage offset, sizes and strides."""
    return torch.empty(0, dtype=view.dtype, device=view.device).set_(
        image.untyped_storage(), view.storage_offset(), view.size(), view.stride())


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
    """Rank 0's ``swiftfusion`` layer of ``model`` on ``nodes`` x ``gpus`` with its inputs.
    ``layer`` is the strategy as users run it (execution plans, the device's default launches
    and CUDA graphs); ``variant`` builds the others over the same transport and buffers."""

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
    usp_ulysses: int = 1
    usp_ring: int = 1

    def __call__(self) -> torch.Tensor:
        return self.layer(self.q, self.k, self.v, self.joint, self.scale)

    def variant(self, plan: bool, launches: str, graphs: bool) -> Callable[[], torch.Tensor]:
        """The layer with its calls made directly (``plan=False``: the schedule walked at every
        call, as before execution plans) or as plans, with ``launches`` ("ring" / "stage") and,
        for plans, CUDA graphs on or off."""
        from ...strategies.torus import TorusAttention
        attn = TorusAttention(self.layer.spec, self.mesh, self.layer.io, 0, [self.comm],
                              {"launches": launches, "cuda_graphs": graphs})
        run = attn if plan else attn.layer
        return lambda: run(self.q, self.k, self.v, self.joint, self.scale)


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
                       model.heads // usp.ulysses, S * W // usp.ring + model.joint, S * W + model.joint,
                       usp.ulysses, usp.ring)


def usp_layer(r: ReplayLayer, name: str, collectives: bool = True) -> UspLayer:
    """xFuser's USP on the same rank (``usp_layer.py``) with backend ``name``'s attention op
    (``cudnn``, ``torch``: torch's flash attention, ``flash``: flash-attn, ``cpu``);
    ``collectives=False``: its attention calls and merges alone."""
    joint = None if r.joint is None else (r.joint.q, r.joint.k, r.joint.v)
    return build_usp(r.q, r.k, r.v, joint, r.usp_ulysses, r.usp_ring, r.scale, _usp_op(name),
                     collectives)


def _usp_op(name: str):
    """(q, k, v, scale) -> (out, lse) of backend ``name``, as xFuser's attention backends call it."""
    if name == "cpu":
        op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        return lambda q, k, v, scale: op(q, k, v, scale=scale)[:2]
    if name == "flash":
        from flash_attn import flash_attn_func

        def flash(q, k, v, scale):
            out, lse, _ = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          softmax_scale=scale, return_attn_probs=True)
            return out.transpose(1, 2), lse
        return flash
    from ...kernels import torch_cuda
    return torch_cuda.cudnn_op if name == "cudnn" else torch_cuda.flash_op


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
    saved = [(t, t.clone()) for t, _ in r.comm._buffers.entries()]
    a = first().clone()
    for t, before in saved:
        t.copy_(before)
    return (a.float() - second().float()).abs().max().item()


def _graph_ms(fn: Callable[[], torch.Tensor], r: ReplayLayer,
              quick: bool) -> tuple[float | None, str, float | None]:
    """(median milliseconds per replay of the layer captured in a CUDA graph, or None; what
    happened: the first error raised inside the capture, not the one ending the capture then
    raises, e.g. 'capturing stream has unjoined work' for the transfers left mid-layer; the
    max abs difference of a replay's output from the eager layer's, or None)."""
    inside: list[BaseException] = []
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the default stream, as capture wants
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        capture = torch.cuda.Stream()  # a failed capture may leave the allocator on its stream
        capture.wait_stream(torch.cuda.current_stream())
        # an outer stream context of ours: torch.cuda.graph's own is not left when its
        # capture_end raises, and this one puts the thread back on its stream
        with torch.cuda.stream(capture), torch.cuda.graph(graph, stream=capture,
                                                          capture_error_mode="thread_local"):
            try:
                out = fn()
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

    diff = same_output(r, fn, replayed)
    return call_ms(graph.replay, r.q.device, quick), "captured", diff


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


@contextlib.contextmanager
def _capture_stand_in(on: bool):
    """On CPU, a graph row's plan captured and replayed under CUDA's capture rules
    (``emulation/cuda_capture.py``): its counts are a replay's."""
    if not on:
        yield
        return
    from ...emulation import cuda_capture
    with cuda_capture.active():
        yield


def _one_layer(r: ReplayLayer, fn: Callable[[], torch.Tensor]) -> dict[str, int]:
    """Run ``fn`` (a variant of the layer) once: its attend calls, copies and transfer bytes."""
    calls0, copies0 = attend_calls(), r.comm.copies
    r.comm.counter.reset()
    fn()
    return {"attend_calls": attend_calls() - calls0, "copies": r.comm.copies - copies0,
            "inter_node_bytes": r.comm.counter.inter_node_bytes,
            "intra_node_bytes": r.comm.counter.intra_node_bytes}


ATTENTION_KERNELS = ("attn", "fmha", "flash", "sdpa", "attention")  # names of attention kernels
MERGE_KERNELS = ("combine", "merge")


def kernel_launches(fn: Callable[[], object], device: torch.device) -> dict[str, int]:
    """Kernels one call of ``fn`` launches, from the profiler: ``attention`` (names with one of
    ``ATTENTION_KERNELS``; on CPU the attention ops), ``merge`` (a fused combine kernel's),
    ``kernels`` (all). A graph replay's kernels count as the replay's."""
    from torch.profiler import ProfilerActivity, profile
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    names = [e.name.lower() for e in prof.events()
             if (e.device_type.name == "CUDA") == cuda and (cuda or e.name.startswith("aten::_scaled_dot"))]
    return {"attention": sum(any(k in n for k in ATTENTION_KERNELS) and not any(m in n for m in MERGE_KERNELS)
                             for n in names),
            "merge": sum(any(m in n for m in MERGE_KERNELS) for n in names), "kernels": len(names)}


def _label(name: str) -> str:
    return LABELS.get(name, name)


# variant -> (plan, launches, CUDA graphs): the layer as before execution plans, then as plans
VARIANTS = {"direct": (False, "ring", False), "plan, ring launches": (True, "ring", False),
            "plan": (True, "stage", False), "plan + CUDA graph": (True, "stage", True)}
PER_BACKEND = {"triton": tuple(VARIANTS)}  # the other backends: the first and last two
OTHER_VARIANTS = ("direct", "plan", "plan + CUDA graph")


def _usp_row(w: RowWriter, r: ReplayLayer, names: list[str], where: str, quick: bool) -> float | None:
    """xFuser's USP on the same rank (``usp_layer.py``), with the op xFuser runs there: cuDNN
    on CUDA (flash-attn where installed), the CPU op on stand-ins. Returns its GPU ms."""
    device = r.q.device
    op = next((n for n in ("flash", "cudnn", "torch", "cpu") if n in names), None)
    if op is None:
        return None
    try:
        layer = usp_layer(r, op)
        gpu, how = kernel_ms(layer, device, quick)
        attention = kernel_ms(usp_layer(r, op, collectives=False), device, quick)[0]
        host = host_and_gpu_ms(layer, device, 3 if quick else 5)[0] if device.type == "cuda" else gpu
        launches = kernel_launches(layer, device)
    except Exception as exc:  # noqa: BLE001
        w.add(f"{where}: USP (xFuser's ring on this rank), {_label(op)}", "FAIL",
              f"{type(exc).__name__}: {exc}"[:400])
        return None
    w.add(f"{where}: USP (xFuser's ring on this rank)", "INFO",
          f"GPU {gpu:.2f} ms ({how}; its attention calls and merges alone {attention:.2f} ms), "
          f"host {host:.2f} ms per layer; Ulysses {r.usp_ulysses} x ring {r.usp_ring}, "
          f"{launches['attention']} attention launches ({_label(op)}) and torch's merge; its "
          "all-to-alls as device copies", backend=op, usp=True, gpu_ms=gpu,
          attention_gpu_ms=attention, host_ms=host, gpu_how=how, launches=launches["attention"],
          kernels=launches["kernels"], U=r.usp_ulysses, R=r.usp_ring, stand_in=device.type != "cuda")
    return gpu


def sglang_layer(r: ReplayLayer, name: str) -> PipelinedUlysses:
    """SGLang's pipelined Ulysses (``sglang_ulysses.py``) on rank 0 of one machine of the
    replay's cluster (Ulysses over its GPUs, ring 1: the only place SGLang pipelines), the
    model's whole sequence over it, text as replicated rows where the model passes them so,
    with backend ``name``'s attention op; its own inputs (from a generator of its own)."""
    model, device = r.model, r.q.device
    U = r.mesh.topology.gpus_per_node
    S, D = -(-(model.tokens - model.joint) // U), model.head_dim
    gen = generator(device, 2)
    make = lambda n: torch.randn(1, model.heads, n, D, device=device, generator=gen).to(r.q.dtype)  # noqa: E731
    joint = (make(model.joint), make(model.joint), make(model.joint)) if model.joint else None
    groups, _ = groups_for(model.heads, U, 1, S * U + model.joint, device)
    return build_pipelined_ulysses(make(S), make(S), make(S), joint, U, groups, r.scale,
                                   _usp_op(name))


def _sglang_row(w: RowWriter, r: ReplayLayer, names: list[str], where: str, quick: bool) -> None:
    """SGLang's pipelined Ulysses (``sglang_ulysses.py``) on rank 0 of one machine, with an op
    SGLang pipelines with: flash-attn (its FA backend) or cuDNN SDPA on CUDA, the CPU op on
    stand-ins."""
    device = r.q.device
    op = next((n for n in ("flash", "cudnn", "cpu") if n in names), None)
    U = r.mesh.topology.gpus_per_node
    case = f"{where}: SGLang's pipelined Ulysses (rank 0 of one machine, U{U})"
    if op is None:
        w.add(case, "SKIP", "no attention op SGLang pipelines with (FA, cuDNN SDPA) runs here")
        return
    try:
        layer = sglang_layer(r, op)
        how_groups = groups_for(r.model.heads, U, 1, layer.rows, device)[1]
        gpu, how = kernel_ms(layer, device, quick)
        host = host_and_gpu_ms(layer, device, 3 if quick else 5)[0] if device.type == "cuda" else gpu
        launches = kernel_launches(layer, device)
    except Exception as exc:  # noqa: BLE001
        w.add(case, "FAIL", f"{type(exc).__name__}: {exc}"[:400])
        return
    S = layer.q.shape[1]
    flops = 4.0 * (r.model.heads // U) * layer.rows * layer.rows * r.model.head_dim
    w.add(case, "INFO",
          f"GPU {gpu:.2f} ms ({how}), host {host:.2f} ms per layer; {layer.groups} head groups of "
          f"{layer.h} heads ({how_groups}), {S} image + {layer.T} text rows per rank, "
          f"{flops / (gpu * 1e-3) / 1e12:.1f} TFLOP/s; {launches['attention']} attention launches "
          f"({_label(op)}); peers' transfers as device copies. On several machines SGLang does not "
          "pipeline (a ring disables it; its transport needs every Ulysses rank on one host)",
          backend=op, sglang_pipelined=True, gpu_ms=gpu, host_ms=host, gpu_how=how, U=U,
          groups=layer.groups, groups_how=how_groups, rows=layer.rows, S=S, T=layer.T, flops=flops,
          launches=launches["attention"], kernels=launches["kernels"],
          stand_in=device.type != "cuda")


def _variant_row(w: RowWriter, r: ReplayLayer, name: str, variant: str, where: str,
                 usp_gpu: float | None, quick: bool) -> float | None:
    """One row: the layer's ``variant`` on backend ``name``; returns its GPU ms."""
    device, cuda = r.q.device, r.q.device.type == "cuda"
    plan, launches, graphs = VARIANTS[variant]
    waits = host = gpu = wall = graph_ms = diff = None
    graph_how = "" if cuda else ("CPU: captured and replayed under the stand-in of CUDA's capture "
                                 "rules (no GPU timing)" if graphs else "CPU: no CUDA graphs")
    try:
        with backend(name), _capture_stand_in(graphs and not cuda):
            fn = r.variant(plan, launches, graphs)
            for _ in range(3 if graphs else 1):  # compile, capture, replay
                fn()
            per_layer = _one_layer(r, fn)
            counted = kernel_launches(fn, device)
            try:
                host, gpu = host_and_gpu_ms(fn, device, 3 if quick else 5)
            except HostWaits as exc:  # a finding: the host cannot run ahead of the GPU
                waits, wall = exc, call_ms(fn, device, quick)
            if cuda and graphs:
                graph_ms, graph_how = call_ms(fn, device, quick), "captured by the plan"
                diff = same_output(r, r.variant(True, launches, False), fn)
            elif cuda and not plan:
                graph_ms, graph_how, diff = _graph_ms(fn, r, quick)
    except Exception as exc:  # noqa: BLE001  (one backend's error costs its row only)
        w.add(f"{where}: {_label(name)}, {variant}", "FAIL", f"{type(exc).__name__}: {exc}"[:400])
        return None
    if waits is not None:
        timing = f"{wall:.2f} ms per layer (wall); {waits}"
        gpu = graph_ms if not graphs else None
    elif cuda:
        bound = "host-bound" if host > gpu else "GPU-bound"
        timing = f"GPU {gpu:.2f} ms, host {host:.2f} ms per layer (host / GPU {host / gpu:.2f}: {bound})"
    else:
        timing = f"{gpu:.2f} ms per layer (CPU stand-in: host and compute are one)"
    if graph_ms is not None and graphs:
        graph = (f"replayed {graph_ms:.2f} ms per layer back to back"
                 + (f" ({graph_ms / gpu:.2f}x its GPU time)" if gpu else "") + ", its output "
                 + ("equals" if diff <= GRAPH_TOLERANCE else "DIFFERS FROM")
                 + f" the eager plan's (max diff {diff:.1e})")
    elif graph_ms is not None:
        graph = (f"the whole call captured: {graph_ms:.2f} ms, its output "
                 + ("equals" if diff <= GRAPH_TOLERANCE else "DIFFERS FROM")
                 + f" the eager layer's (max diff {diff:.1e})")
    else:
        graph = graph_how or "no CUDA graph"
    vs_usp = (f"; {gpu / usp_gpu:.2f}x USP's GPU time" if usp_gpu and gpu else "")
    w.add(f"{where}: {_label(name)}, {variant}",
          "FAIL" if diff is not None and not diff <= GRAPH_TOLERANCE else "INFO",
          f"{timing}{vs_usp}; {graph}; {counted['attention']} attention launches, "
          f"{per_layer['attend_calls']} attend calls, {per_layer['copies']} copies for "
          f"{(per_layer['inter_node_bytes'] + per_layer['intra_node_bytes']) / 2**20:.1f} MiB of transfers",
          backend=name, variant=variant, plan=plan, launch_mode=launches, graphs=graphs and cuda,
          gpu_ms=gpu, host_ms=host, host_bound=None if host is None or gpu is None else host > gpu,
          host_waits=waits is not None, wall_ms=wall, graph_ms=graph_ms, graph=graph_how,
          graph_diff=diff, usp_gpu_ms=usp_gpu, usp_ratio=gpu / usp_gpu if usp_gpu and gpu else None,
          launches=counted["attention"], merge_launches=counted["merge"], kernels=counted["kernels"],
          mesh=r.mesh.describe(), T=r.mesh.torus, U=r.mesh.ulysses_intra, R=r.mesh.ring,
          stand_in=not cuda, **per_layer)
    return gpu


def replay(w: RowWriter, device: torch.device, quick: bool = False) -> None:
    """The replay stage (see the module docstring): per model, xFuser's USP on the same rank,
    SGLang's pipelined Ulysses on rank 0 of one machine, then a row per backend and variant of
    our layer, then the USP-equivalent single kernel."""
    cuda = device.type == "cuda"
    dtype = torch.bfloat16
    for model in models(device):
        r = build_layer(model, device, dtype)
        names = runnable(None, device, model.head_dim, dtype)
        where = f"{model.name} rank 0 of 4x8 ({r.mesh.describe()})"
        usp_gpu = _usp_row(w, r, names, where, quick)
        _sglang_row(w, r, names, where, quick)
        layer_gpu: dict[str, float] = {}
        for name in names:
            for variant in PER_BACKEND.get(name, OTHER_VARIANTS if cuda else ("direct", "plan", "plan + CUDA graph")):
                gpu = _variant_row(w, r, name, variant, where, usp_gpu, quick)
                if gpu is not None and (cuda or not VARIANTS[variant][2]):  # (stand-in graphs: no timing)
                    key = f"{name}, {variant}"
                    layer_gpu[key] = gpu
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
                  f"best layer ({best}) {layer_gpu[best]:.2f} ms = "
                  f"{layer_gpu[best] / floor:.2f}x the single kernel",
                  single_ms=single, best_layer=best, layer_gpu_ms=layer_gpu, flops=flops,
                  ratio=layer_gpu[best] / floor, usp_gpu_ms=usp_gpu, stand_in=not cuda)
        r.comm.close()
        del r
        if cuda:
            torch.cuda.empty_cache()


__all__ = ["ReplayComm", "ReplayLayer", "build_layer", "kernel_launches", "replay", "sglang_layer",
           "usp_layer", "usp_single_kernel"]
