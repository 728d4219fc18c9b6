"""Execution plans (``plan.py``, ``strategies/planned.py``) and the fused launch schedule.

A strategy compiles its layer once per input signature and runs the plan afterwards: every
later call must equal single-device attention as the first does (different inputs each call),
in both launch modes, with text tokens, key masks and grouped-query K/V; the compile guard must
catch work done outside a recorded step; the plan cache is bounded and counted.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import xfuser_swiftfusion as sf
from xfuser_swiftfusion import plan
from xfuser_swiftfusion.emulation.launcher import run_emulated
from xfuser_swiftfusion.strategies.planned import PlanCache, graphs_requested
from xfuser_swiftfusion.strategies.torus import TEXT, Launch, fused_schedule, torus_schedule
from support.reference import layer_inputs, max_abs_err, rank_rows


# --- plan.py ------------------------------------------------------------------------------

class _Handle:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def wait(self) -> None:
        self.log.append(("wait", self.name))


def test_compile_records_and_run_replays_in_order():
    log: list = []
    x = torch.zeros(3)

    def layer(a: torch.Tensor) -> None:
        buf = torch.empty(3)  # the plan's buffer: allocated once, at compile time
        plan.call(lambda: log.append("call") or buf.copy_(a + 1))
        h = plan.issue(lambda: log.append("issue") or _Handle(log, "h"))
        h.wait()
        plan.output(lambda: buf.clone())

    p = plan.compile(layer, x)
    assert log == [] and len(p) == 3 and p.slots == 1  # nothing ran at compile time
    x.fill_(4)
    out = p.run()
    assert log == ["call", "issue", ("wait", "h")]
    assert torch.equal(out, torch.full((3,), 5.0))
    x.fill_(6)
    assert torch.equal(p.run(), torch.full((3,), 7.0))  # the step reads the data of the run


def test_outside_compile_the_calls_act_at_once():
    t = torch.zeros(2)
    assert plan.call(lambda: t.add_(1)) is t and torch.equal(t, torch.ones(2))
    assert plan.issue(lambda: "handle") == "handle"
    assert plan.output(lambda: 3) == 3
    assert plan.then(3, lambda x: x + 1) == 4


@pytest.mark.parametrize("op", ["copy", "zeros", "clone", "reshape-copy", "item", "cat"])
def test_the_guard_catches_work_outside_a_step(op):
    x = torch.randn(4, 6)

    def layer(a: torch.Tensor) -> None:
        buf = torch.empty(4, 6)
        {"copy": lambda: buf.copy_(a), "zeros": lambda: torch.zeros(3), "clone": lambda: a.clone(),
         "reshape-copy": lambda: a.t().reshape(24), "item": lambda: a.sum().item(),
         "cat": lambda: torch.cat([a, a])}[op]()

    with pytest.raises(plan.UnrecordedOp, match="outside a recorded step"):
        plan.compile(layer, x)


def test_the_guard_lets_views_allocations_and_preparing_pass():
    def layer(a: torch.Tensor) -> None:
        a.view(2, 12)[0], a.unbind(0), a.permute(1, 0), a[:, 1:3], a.view(torch.uint8), a.expand(2, 4, 6)
        torch.empty(5), torch.empty_like(a), a.new_empty(3)
        with plan.preparing():
            torch.zeros(3).add_(1)
        plan.output(lambda: a.sum())

    assert plan.compile(layer, torch.randn(4, 6)).run() is not None


def test_the_guard_is_back_after_preparing():
    """Work inside nested ``preparing()`` blocks passes, work after a block is caught again."""
    def nested(a: torch.Tensor) -> None:
        with plan.preparing():
            with plan.preparing():
                a.clone()
            a.clone()  # still inside the outer block

    def after(a: torch.Tensor) -> None:
        with plan.preparing():
            a.clone()
        a.clone()

    plan.compile(nested, torch.randn(4, 6))
    with pytest.raises(plan.UnrecordedOp, match="outside a recorded step"):
        plan.compile(after, torch.randn(4, 6))


def test_allocations_at_compile_keep_their_arguments():
    """An allocation while compiling passes the guard with its dtype and shape (the keyword
    arguments reach the op)."""
    seen = []

    def layer(a: torch.Tensor) -> None:
        seen.extend([torch.empty(3, dtype=torch.float64), a.new_empty(2, dtype=torch.int32),
                     torch.empty_like(a, dtype=torch.bfloat16)])

    plan.compile(layer, torch.randn(4, 6))
    assert [(x.dtype, tuple(x.shape)) for x in seen] == [
        (torch.float64, (3,)), (torch.int32, (2,)), (torch.bfloat16, (4, 6))]


def test_compile_is_not_reentrant_and_then_composes_outputs():
    def inner(a):
        plan.output(lambda: a * 2)

    def outer(a):
        inner(a)
        return plan.then(None, lambda o: o + 1)

    a = torch.ones(2)
    assert torch.equal(plan.compile(outer, a).run(), torch.full((2,), 3.0))
    with pytest.raises(RuntimeError, match="inside a compile"):
        plan.compile(lambda a: plan.compile(inner, a), a)


# --- PlanCache ----------------------------------------------------------------------------

def _local_layer(counter: list):
    """A one-rank layer through the plan calls: softmax attention, text rows first."""
    def layer(q, k, v, joint, scale, key_mask=None):
        counter.append(tuple(q.shape))
        out = torch.empty(q.shape, dtype=q.dtype)
        plan.call(lambda: out.copy_(torch.softmax(q @ k.transpose(-1, -2) * scale, -1) @ v))
        return plan.output(lambda: out.clone())
    return layer


def test_plan_cache_compiles_once_per_signature_and_is_bounded():
    compiles: list = []
    cache = PlanCache(_local_layer(compiles), size=2, comms=[], graphs=None)
    g = torch.Generator().manual_seed(0)
    for L in (4, 4, 6, 4, 8, 4, 6):
        q, k, v = (torch.randn(1, 2, L, 8, generator=g) for _ in range(3))
        want = torch.softmax(q @ k.transpose(-1, -2) * 0.5, -1) @ v
        assert torch.allclose(cache(q, k, v, None, 0.5), want)
    # 4, 6, (4 hit), 8 evicts 6, (4 hit), 6 again
    assert [s[2] for s in compiles] == [4, 6, 8, 6]
    assert cache.stats()["plans_compiled"] == 4 and cache.stats()["plans_cached"] == 2


def test_plan_stats_add_up_a_strategy_and_its_children():
    """``plan_stats``: the counters of a strategy's ``plans`` plus those of the strategies it
    delegates to (``plan_children``), counted here by hand."""
    from xfuser_swiftfusion.strategies.planned import plan_stats

    class Strategy:
        def __init__(self, children=()):
            self.plans = PlanCache(_local_layer([]), comms=[], graphs=None)
            self.children = list(children)

        def plan_children(self):
            return self.children

    child, parent = Strategy(), None
    parent = Strategy([child])
    for cache, lengths in ((parent.plans, (4, 6, 4)), (child.plans, (5,))):
        for L in lengths:
            q = torch.randn(1, 2, L, 8)
            cache(q, q, q, None, 0.5)
    # 3 signatures, one step each (the layer's one plan.call)
    assert plan_stats(parent) == {"plans_compiled": 3, "plans_cached": 3, "plan_steps": 3,
                                  "graphs_captured": 0}
    assert plan_stats(object()) == {"plans_compiled": 0, "plans_cached": 0, "plan_steps": 0,
                                     "graphs_captured": 0}


def test_cuda_graphs_option_and_environment(monkeypatch):
    monkeypatch.delenv("SWIFTFUSION_CUDA_GRAPHS", raising=False)
    assert graphs_requested({}) is None
    assert graphs_requested({"cuda_graphs": False}) is False
    monkeypatch.setenv("SWIFTFUSION_CUDA_GRAPHS", "off")
    assert graphs_requested({}) is False and graphs_requested({"cuda_graphs": True}) is True
    monkeypatch.setenv("SWIFTFUSION_CUDA_GRAPHS", "maybe")
    with pytest.raises(ValueError, match="on or off"):
        graphs_requested({})
    with pytest.raises(TypeError):
        graphs_requested({"cuda_graphs": "on"})


def test_graphs_are_on_for_cuda_tensors_unless_turned_off():
    """``graphs``: None (the default) and True capture CUDA tensors' plans, False never; CPU
    tensors' plans are never captured."""
    on = {g: PlanCache(lambda *a: None, comms=[], graphs=g)._graphs_on for g in (None, True, False)}
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert [on[g](cuda) for g in (None, True, False)] == [True, True, False]
    assert [on[g](cpu) for g in (None, True, False)] == [False, False, False]


# --- the fused schedule -------------------------------------------------------------------

@pytest.mark.parametrize("T", [1, 2, 3, 4])
@pytest.mark.parametrize("text", [False, True])
def test_fused_schedule_keeps_the_schedules_work(T, text):
    """Every (query entry, K/V entry) pair once, each entry finalized once by its last launch,
    the non-compute steps in torus_schedule's order; at most T + 2 (T - 1) launches."""
    for t in range(T):
        plain, fused = torus_schedule(T, t, text), fused_schedule(T, t, text)
        pairs = sorted((str(q), str(s.kv)) for s in plain if s.kind == "attend" for q in s.q)
        launched = sorted((str(q), str(kv)) for s in fused if isinstance(s, Launch) for q in s.q for kv in s.kv)
        assert launched == pairs
        finals = [q for s in fused if isinstance(s, Launch) and s.finalize for q in s.q]
        assert sorted(map(str, finals)) == sorted(map(str, [*range(T), *([TEXT] if text else [])]))
        for s in fused:
            if isinstance(s, Launch) and s.finalize:  # nothing attends an entry after its finalize
                later = fused[fused.index(s) + 1:]
                assert not any(isinstance(x, Launch) and set(x.q) & set(s.q) for x in later)
        others = lambda steps: [(s.kind, s.k, str(s.q), str(s.kv)) for s in steps  # noqa: E731
                                if s.kind not in ("attend", "finalize", "launch")]
        assert others(fused) == others(plain)
        assert sum(isinstance(s, Launch) for s in fused) <= T + 2 * (T - 1)


def test_fused_schedule_launch_counts():
    """Flux on 4 x 8 (T = 4, text): 10 launches instead of torus_schedule's 19 attends and
    finalizations (44 launches with a ring of 4)."""
    assert sum(isinstance(s, Launch) for s in fused_schedule(4, 1, True)) == 10
    assert sum(isinstance(s, Launch) for s in fused_schedule(2, 0, True)) == 4


# --- strategies: repeated calls of one signature run the plan -----------------------------

def _repeated_calls_rank(strategy: str, launches: str, cases: list[tuple]) -> list[tuple]:
    """Three calls per case (new inputs each), each against single-device attention; the
    context's plan counters after all of them."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    with sf.init_sequence_parallel(strategy, cases[0][0], timeout_s=60,
                                   options={"launches": launches}) as ctx:
        for H, Hkv, Tj, masked, dtype in cases:
            B, D, S = 2, 16, 6
            L = S * world
            mine = slice(rank * S, (rank + 1) * S)
            errs = []
            for call in range(3):
                g = torch.Generator().manual_seed(1000 * call + 10 * Tj + Hkv)
                q, k, v, jq, jk, jv, mask = layer_inputs(g, B, H, Hkv, L, Tj, D, dtype, masked)
                kw = dict(joint_query=jq, joint_key=jk, joint_value=jv, joint_strategy="rear") if Tj else {}
                if masked:
                    kw["key_mask"] = mask
                out = ctx.attention(q[:, :, mine], k[:, :, mine], v[:, :, mine], **kw)
                ref = rank_rows(q, k, v, rank, world, (jq, jk, jv) if Tj else None, "rear", key_mask=mask)
                errs.append(max_abs_err(out, ref))
            rows.append((H, Hkv, Tj, masked, str(dtype), errs))
        stats = ctx.stats()
    return [(strategy, launches, rows, stats["plans_compiled"], stats["strategy"])]


CASES = [(4, 4, 0, False, torch.float32), (4, 2, 5, True, torch.float32), (4, 4, 3, False, torch.bfloat16)]


@pytest.mark.parametrize("topo", ["2x4", "4x2"])
@pytest.mark.parametrize("launches", ["stage", "ring"])
def test_repeated_calls_equal_single_device_attention(topo, launches):
    """2x4: T2 U2 R2; 4x2: T4 U1 R2 (4 heads): the ring gathers of the fused launches and the
    ring steps of the other mode, every later call running the first call's plan."""
    for strategy in ("torus", "swiftfusion"):
        for rank_rows_ in run_emulated(_repeated_calls_rank, topo, strategy, launches, CASES, timeout_s=300):
            for name, mode, rows, compiled, ran in rank_rows_:
                assert ran == name
                assert compiled == len(CASES), (name, mode, compiled)
                for H, Hkv, Tj, masked, dtype, errs in rows:
                    tol = 2e-2 if "bfloat16" in dtype else 1e-5
                    assert max(errs) <= tol, (topo, name, mode, H, Hkv, Tj, masked, dtype, errs)


# --- CUDA graphs of plans (the orchestration, on a fake CUDA graph) ------------------------

class _FakeCuda:
    """``torch.cuda.CUDAGraph`` / ``torch.cuda.graph`` as capture behaves: work issued while
    capturing is recorded into the graph, not run; ``replay`` runs it."""

    def __init__(self, monkeypatch, fail: bool = False) -> None:
        import contextlib
        self.capturing, self.graph, self.fail = False, None, fail
        self.log: list[str] = []  # stream waits and captures, in order
        fake = self

        class Graph:
            def __init__(self) -> None:
                self.nodes: list = []

            def replay(self) -> None:
                for node in self.nodes:
                    node()

        class Stream:
            device = torch.device("cpu")

            def wait_stream(self, other) -> None:
                fake.log.append("wait_stream")

        @contextlib.contextmanager
        def graph(g, stream=None, capture_error_mode="global"):
            assert capture_error_mode == "thread_local"  # the watchdogs keep querying meanwhile
            fake.capturing, fake.graph = True, g
            fake.log.append("capture")
            try:
                yield
            except BaseException:  # capture_end on an invalidated capture raises its own error
                raise RuntimeError("operation failed due to a previous error during capture")
            finally:
                fake.capturing = False

        class Event:
            recorded = False

            def record(self, stream=None) -> None:
                self.recorded = True

        monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
        monkeypatch.setattr(torch.cuda, "graph", graph)
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: Stream())
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
        monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
        self.synchronized = 0

        def synchronize(device=None) -> None:
            fake.synchronized += 1
        monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
        monkeypatch.setattr(PlanCache, "_graphs_on", lambda self, device: True)

    def work(self, fn):
        """A step's work as a GPU kernel: recorded while capturing, run otherwise."""
        def issue():
            if self.capturing:
                if self.fail:
                    raise RuntimeError("operation not permitted when stream is capturing")
                self.graph.nodes.append(fn)
            else:
                fn()
        return issue


class _Comm:
    """What a plan cache asks of a communicator around graphs."""

    def __init__(self) -> None:
        import contextlib
        from xfuser_swiftfusion.comm.base import ByteCounter
        self.counter = ByteCounter([0, 1], 0)
        self.watched, self.captures = [], 0
        self.capture_refused, self.replay_counts, self.rank = None, (), 0
        comm = self

        @contextlib.contextmanager
        def capturing():
            comm.captures += 1
            yield
        self.capturing = capturing

    def watch(self, event, what, doing="") -> None:
        assert event.recorded, f"{what}: watching an event never recorded"
        self.watched.append(what)

    def check(self) -> None:
        pass


def test_graphs_capture_at_the_second_call_and_replay_after(monkeypatch, caplog):
    from xfuser_swiftfusion.kernels import dispatch
    cuda, comm = _FakeCuda(monkeypatch), _Comm()
    python_steps = []

    def layer(q, k, v, joint, scale, key_mask=None):
        out = torch.empty(q.shape)

        def step():
            python_steps.append(cuda.capturing)
            comm.counter.count(1, 8)  # a transfer issued by the step's Python
            dispatch.add_attend_calls(1)  # and a counted kernel launch
        plan.call(step)
        plan.call(cuda.work(lambda: out.copy_(q * 2)))
        return plan.output(lambda: out.clone())

    cache = PlanCache(layer, comms=[comm], graphs=None, name="test layer")
    attends = dispatch.attend_calls()
    g = torch.Generator().manual_seed(0)
    outs = []
    for _ in range(4):
        q = torch.randn(1, 2, 3, 4, generator=g)
        outs.append((cache(q, q, q, None, 1.0), q))
    assert all(torch.equal(o, 2 * q) for o, q in outs)  # the replays read each call's inputs
    assert python_steps == [False, True]  # eager warm-up, capture; the replays run no Python
    assert comm.captures == 1 and comm.watched == ["test layer: CUDA graph replay"] * 3
    assert comm.counter.inter_node_bytes == 8 * 4  # replays count what their capture issued
    assert dispatch.attend_calls() - attends == 4
    assert cache.stats()["graphs_captured"] == 1
    assert cuda.log == ["wait_stream", "capture"]  # the capture stream waits for the inputs' copies


def _copying_layer(cuda, comm):
    """A layer whose step counts one copy in ``comm.copies`` (a ``replay_counts`` counter)."""
    def layer(q, k, v, joint, scale, key_mask=None):
        out = torch.empty(q.shape)

        def step():
            comm.copies += 1
        plan.call(step)
        plan.call(cuda.work(lambda: out.copy_(q - 1)))
        return plan.output(lambda: out.clone())
    return layer


def test_replays_advance_the_communicators_own_counters_and_raise_their_errors(monkeypatch):
    cuda, comm = _FakeCuda(monkeypatch), _Comm()
    comm.replay_counts, comm.copies, checks = ("copies",), 0, []

    def check():
        checks.append(comm.copies)
        if len(checks) == 3:
            raise RuntimeError("watchdog: rank 1 stopped answering")
    comm.check = check
    cache = PlanCache(_copying_layer(cuda, comm), comms=[comm], graphs=None, name="copying layer")
    for _ in range(4):  # warm-up, capture, two replays
        q = torch.randn(2, 3)
        assert torch.equal(cache(q, q, q, None, 1.0), q - 1)
    assert comm.copies == 4 and checks == [2, 3]  # each replay counts the one copy it does
    with pytest.raises(RuntimeError, match="stopped answering"):  # a watchdog's finding
        cache(q, q, q, None, 1.0)


def test_graphs_off_where_a_communicator_refuses_capture(caplog):
    comm = _Comm()
    comm.capture_refused = "a stand-in heap copies on the host"
    cache = PlanCache(lambda *a: None, comms=[comm], graphs=None, name="refused layer")
    with caplog.at_level("WARNING"):
        assert cache._graphs_on(torch.device("cuda", 0)) is False
    assert any("stand-in heap" in r.getMessage() for r in caplog.records)


def test_a_strategys_cache_takes_its_options_and_its_spec_name(monkeypatch):
    from types import SimpleNamespace
    monkeypatch.delenv("SWIFTFUSION_CUDA_GRAPHS", raising=False)

    class Named:
        spec, comms = SimpleNamespace(name="torus"), []

        def layer(self, *a):
            return None

    class Plain(Named):
        spec = None
    off = PlanCache.for_strategy(Named(), {"cuda_graphs": False})
    assert (off.graphs, off.name) == (False, "torus")
    default = PlanCache.for_strategy(Plain(), None)
    assert (default.graphs, default.name) == (None, "Plain")


def test_a_failed_capture_runs_the_plan_eagerly_and_says_why_once(monkeypatch, caplog):
    cuda = _FakeCuda(monkeypatch, fail=True)

    def layer(q, k, v, joint, scale, key_mask=None):
        out = torch.empty(q.shape)
        plan.call(cuda.work(lambda: out.copy_(q + 1)))
        return plan.output(lambda: out.clone())

    cache = PlanCache(layer, comms=[], graphs=None, name="failing layer")
    with caplog.at_level("WARNING"):
        for _ in range(3):
            q = torch.randn(2, 3)
            assert torch.equal(cache(q, q, q, None, 1.0), q + 1)
    said = [r.getMessage() for r in caplog.records if "could not be captured" in r.getMessage()]
    assert len(said) == 1 and "operation not permitted" in said[0] and "runs eagerly" in said[0]
    assert cuda.synchronized == 1  # the failed capture's work is done before eager runs
    assert cache.stats()["graphs_captured"] == 0


# --- the fused launches' operations: formulas, programs and counted calls agree ------------

def expected_stage(strategy: str, T: int, U: int, R: int) -> dict:
    """Per call with ``launches="stage"``: 3T - 2 launches (T Pull-Q, T - 2 Pull-KV, T in the
    last stage), each of the T blocks gathered once over a ring of R (one-sided: R - 1 gets;
    two-sided: one exchange of K and V with each of R - 1 peers)."""
    launches = 3 * T - 2
    if strategy == "torus":
        return {"transfers": 4 * (U - 1) + 4 * U * (T - 1) + 2 * T * (R - 1),
                "attend_calls": launches, "barriers": 0,
                "grouped_exchanges": 4 * (U > 1) + 4 * (T - 1) + T * (R > 1)}
    return {"transfers": 4 * (U - 1) + 3 * U * (T - 1) + T * (R - 1), "attend_calls": launches,
            "grouped_exchanges": 0, "barriers": 2 + (T - 1) * (R > 1)}


STAGE_CASES = {("2x4", 4): (2, 2, 2), ("4x2", 4): (4, 1, 2), ("2x2", 4): (2, 2, 1)}
OPS = ("transfers", "grouped_exchanges", "barriers", "attend_calls")


def _stage_counts(heads: int) -> dict:
    x = torch.randn(1, heads, 8, 8, generator=torch.Generator().manual_seed(dist.get_rank()))
    out = {}
    for s in ("torus", "swiftfusion"):
        with sf.init_sequence_parallel(s, heads, timeout_s=60, options={"launches": "stage"}) as ctx:
            ctx.attention(x, x, x)
            ctx.reset_stats()
            for _ in range(2):
                ctx.attention(x, x, x)
            st, m = ctx.stats(), ctx.mesh
            out[s] = ({k: st[k] / 2 for k in (*OPS, "inter_node_bytes", "intra_node_bytes")},
                      (m.torus, m.ulysses_intra, m.ring))
    return out


@pytest.mark.parametrize("topology,heads", list(STAGE_CASES))
def test_fused_launch_operations_follow_the_formulas_and_the_programs(topology, heads):
    from xfuser_swiftfusion.mesh import choose_mesh
    from xfuser_swiftfusion.strategies.ops import Shape, counts, sent_bytes
    from xfuser_swiftfusion.strategies.registry import get
    from xfuser_swiftfusion.topology import Topology
    t = Topology.parse(topology)
    for rank, per in enumerate(run_emulated(_stage_counts, topology, heads, timeout_s=240)):
        for s, (stats, tur) in per.items():
            assert tur == STAGE_CASES[(topology, heads)]
            want = expected_stage(s, *tur)
            assert {k: stats[k] for k in OPS} == want, (topology, s, rank, stats)
            spec = get(s)
            mesh = choose_mesh(t, heads, spec.placement)
            ops = spec.program(mesh, rank, Shape(1, 8, heads, 8, 0, 4), launches="stage")
            assert counts(ops) == want, (topology, s, rank)
            node = t.node_of
            inter = sent_bytes(ops, {p for p in range(t.world_size) if node(p) != node(rank)})
            assert inter == stats["inter_node_bytes"] and sent_bytes(ops) == (
                stats["inter_node_bytes"] + stats["intra_node_bytes"]), (topology, s, rank)


# --- attend on CUDA's SDPA backends: prepared once for a plan -------------------------------

def test_sdpa_backends_are_prepared_with_the_chunks_that_have_rows(monkeypatch):
    """cudnn / torch calls on CUDA tensors without a key mask are ``prepare_torch``'s (joined
    buffers, op, split and combine table built once); empty query or K/V chunks are left out
    (the op takes none), a call without keys is the combine's finalization alone."""
    from xfuser_swiftfusion.kernels import combine, dispatch, new_states, torch_cuda
    seen = []
    monkeypatch.setattr(torch_cuda, "prepare_torch", lambda qs, kvs, sts, scale, op=None, out=None:
                        seen.append(("op", [q.shape[2] for q in qs], [k.shape[2] for k, _ in kvs],
                                     op is torch_cuda.cudnn_op, None if out is None else len(out)))
                        or (lambda: seen.append("launch")))
    monkeypatch.setattr(combine, "prepare_combine", lambda sts, p, l, out=None:
                        seen.append(("finalize", len(sts), len(out))) or (lambda: None))
    q = [torch.zeros(1, 2, n, 8) for n in (3, 0, 5)]
    kv = [(torch.zeros(1, 2, n, 8),) * 2 for n in (4, 0)]
    states = new_states(q)
    outs = [torch.empty_like(x) for x in q]
    dispatch._prepare_sdpa("cudnn", q, kv, states, 0.5, outs)()
    dispatch._prepare_sdpa("torch", q, kv, states, 0.5, None)()
    dispatch._prepare_sdpa("cudnn", q, [kv[1]], states, 0.5, outs)()
    assert seen == [("op", [3, 5], [4], True, 2), "launch", ("op", [3, 5], [4], False, None),
                    "launch", ("finalize", 2, 2)]


def test_replay_doing_names_six_stages_then_counts_the_rest():
    from xfuser_swiftfusion.strategies.planned import replay_doing
    six = [((1,), "put", f"s{i}") for i in range(6)]
    text = replay_doing("torus", six, 0)
    assert "'s5'" in text and "more" not in text
    text = replay_doing("torus", six + [(None, "barrier", "s6"), ((0, 2), "get", "s6")], 0)
    assert "'s5'" in text and "'s6'" not in text and "and 1 more" in text
    assert "peers [1, 2]" in text and "a barrier over all ranks" in text and "8 transfers" in text
    assert "a barrier over all ranks" not in replay_doing("torus", six, 0)
