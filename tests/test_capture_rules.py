"""Every strategy's plans under CUDA's rules of capture, on CPU (``emulation/cuda_capture.py``).

The stand-in makes a plan cache capture and replay plans on CPU tensors and raises where CUDA
would (a captured event or NCCL work queried, a host synchronisation while capturing, a
capturing stream waiting on uncaptured work, unjoined streams, memory freed under a graph).
Every registered strategy (``tas``, ``torus``, ``swiftfusion``, ``auto``, with padded heads,
``fp8_comms``, text tokens, key masks, grouped-query K/V) runs three calls per case with graphs
on (eager, captured, replayed), each against the fp64 single-device reference: no rule broken,
one graph per case, the replays counted in ``ctx.stats()``, and ``cuda_graphs=False`` obeyed.
"""
from __future__ import annotations

import contextlib
import time

import pytest
import torch
import torch.distributed as dist

import xfuser_swiftfusion as sf
from support.reference import layer_inputs, max_abs_err, rank_rows
from xfuser_swiftfusion import plan
from xfuser_swiftfusion.emulation import cuda_capture as cc
from xfuser_swiftfusion.emulation.launcher import run_emulated
from xfuser_swiftfusion.strategies.padded import PaddedAttention
from xfuser_swiftfusion.strategies.planned import PlanCache, plan_stats


@pytest.fixture
def stand_in():
    cc.install()
    try:
        yield cc
    finally:
        cc.uninstall()


# --- the rules themselves ---------------------------------------------------------------------

@contextlib.contextmanager
def _capture(g):
    side = torch.cuda.Stream()
    with torch.cuda.stream(side), torch.cuda.graph(g, stream=side, capture_error_mode="thread_local"):
        yield side


@pytest.mark.parametrize("breach,error", [
    (lambda ev, w, other: ev.query(), cc.CAPTURED_EVENT),
    (lambda ev, w, other: ev.synchronize(), cc.CAPTURED_EVENT),
    (lambda ev, w, other: w.is_completed(), cc.CAPTURED_EVENT),     # WorkNCCL::isCompleted
    (lambda ev, w, other: w.wait(timeout=1.0), cc.UNSUPPORTED),     # blocks the host
    (lambda ev, w, other: torch.cuda.synchronize(), cc.UNSUPPORTED),
    (lambda ev, w, other: torch.ones(1).item(), cc.UNSUPPORTED),
    (lambda ev, w, other: torch.cuda.current_stream().wait_event(other), cc.ISOLATION),
])
def test_what_cuda_refuses_during_a_capture_raises(stand_in, breach, error):
    """Each breach raises its CUDA error and invalidates the capture: capture_end raises."""
    class Work:
        def is_completed(self):
            return True

        def wait(self, timeout=None):
            return True
    other = torch.cuda.Event()
    other.record()  # outside the capture
    g = torch.cuda.CUDAGraph()
    with pytest.raises(cc.CaptureRuleError) as got:
        with _capture(g):
            ev = torch.cuda.Event()
            ev.record()
            work = cc.StandInWork(Work())
            with pytest.raises(cc.CaptureRuleError, match=error.split("(")[-1].rstrip(")")):
                breach(ev, work, other)
    assert "cudaErrorStreamCaptureInvalidated" in str(got.value)
    assert not g.captured and cc.STATS.violations


def test_a_captured_event_stays_unqueryable_after_the_capture(stand_in):
    """The watchdog's thread polling an event or work of a capture fails even later."""
    g = torch.cuda.CUDAGraph()
    with _capture(g):
        ev = torch.cuda.Event()
        ev.record()
    with pytest.raises(cc.CaptureRuleError, match="907"):
        ev.query()


def test_forked_streams_must_be_joined_and_memory_must_outlive_the_graph(stand_in):
    g = torch.cuda.CUDAGraph()
    fork = torch.cuda.Stream()
    with pytest.raises(cc.CaptureRuleError, match="unjoined"):
        with _capture(g) as side:
            fork.wait_stream(side)  # joins the capture
            with torch.cuda.stream(fork):
                torch.zeros(2).add_(1)  # work never joined back
    x = torch.ones(3)
    g = torch.cuda.CUDAGraph()
    with _capture(g) as side:
        x.mul_(2)
    g.replay()
    del x  # the graph still uses it
    with pytest.raises(cc.CaptureRuleError, match="freed"):
        g.replay()


def _doubling_layer(calls: list):
    def layer(q, k, v, joint, scale, key_mask=None):
        out = torch.empty(q.shape)
        plan.call(lambda: calls.append(1))
        plan.call(lambda: torch.mul(q, 2, out=out))
        return plan.output(lambda: out.clone())
    return layer


def test_a_plan_cache_captures_once_and_replays_the_steps(stand_in):
    calls: list = []
    cache = PlanCache(_doubling_layer(calls), comms=[], graphs=None, name="doubling")
    for i in range(4):
        q = torch.randn(1, 2, 3, 4)
        assert torch.equal(cache(q, q, q, None, 1.0), 2 * q), i
    assert cache.stats()["graphs_captured"] == 1
    assert cc.STATS.captures == 1 and cc.STATS.replays == 3 and not cc.STATS.violations
    assert len(calls) == 2 + 3  # eager, capture; the replays run the recorded steps


def test_a_failed_capture_leaves_the_callers_stream_and_allocations_as_they_were(stand_in, caplog):
    """torch.cuda.graph's __exit__ raises in capture_end before leaving its stream context;
    the plan cache's outer context puts the caller back on its stream, whose allocations the
    allocator never took for a capture; the plan then runs eagerly."""
    def breaking(q, k, v, joint, scale, key_mask=None):
        out = torch.empty(q.shape)
        plan.call(lambda: torch.cuda.synchronize())  # a host synchronisation: illegal in capture
        plan.call(lambda: torch.add(q, 1, out=out))
        return plan.output(lambda: out.clone())

    caller = torch.cuda.Stream()
    with torch.cuda.stream(caller):
        cache = PlanCache(breaking, comms=[], graphs=None, name="breaking")
        with caplog.at_level("WARNING"):
            for _ in range(3):
                q = torch.randn(2, 3)
                assert torch.equal(cache(q, q, q, None, 1.0), q + 1)
        assert torch.cuda.current_stream() is caller
        assert id(caller) not in cc.allocator_capturing and cc.STATS.failed_captures == 1
        assert torch.zeros(4).add_(1).sum().item() == 4  # later allocations and syncs: as before
    assert cache.stats()["graphs_captured"] == 0
    assert any("could not be captured" in r.getMessage() for r in caplog.records)
    # the hazard itself: torch's context alone leaves the thread on the capture stream
    with torch.cuda.stream(caller):
        with pytest.raises(cc.CaptureRuleError):
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                torch.cuda.synchronize()
        assert torch.cuda.current_stream() is not caller


# --- every strategy under the rules -----------------------------------------------------------

# (strategy, heads, kv heads, text tokens, key mask, dtype, options)
FULL = [
    ("tas", 4, 2, 5, True, torch.float32, {}),
    ("torus", 4, 4, 3, False, torch.float32, {}),
    ("swiftfusion", 4, 2, 0, True, torch.float32, {}),
    ("auto", 4, 4, 0, False, torch.float32, {"external": False}),  # not xFuser's usp
    ("torus", 3, 3, 2, True, torch.float32, {}),         # padded heads (3 -> 4 on 2x2)
    ("swiftfusion", 3, 3, 0, False, torch.float32, {}),  # padded heads
    ("tas", 4, 4, 0, False, torch.bfloat16, {"fp8_comms": True}),
    ("torus", 4, 4, 0, True, torch.bfloat16, {"fp8_comms": True}),
    ("tas", 4, 4, 0, False, torch.float32, {"cuda_graphs": False}),
    ("torus", 3, 3, 0, False, torch.float32, {"cuda_graphs": False}),
]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
FP8_BOUND = 0.25  # max abs error / max |reference| with fp8_comms (tests/test_fp8_comms.py)


def _strategies_rank(cases: list[tuple]) -> list[dict]:
    """Each case: three calls (eager, captured, replayed) with new inputs, under the rules."""
    cc.install()
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for strategy, H, Hkv, Tj, masked, dtype, options in cases:
        B, D, S = 1, 16, 4
        L = S * world
        mine = slice(rank * S, (rank + 1) * S)
        errs, bounds, bytes_ = [], [], []
        before = (cc.STATS.replays, list(cc.STATS.violations))
        with sf.init_sequence_parallel(strategy, H, timeout_s=30,
                                       options={"cuda_graphs": True, **options}) as ctx:
            for call in range(3):
                g = torch.Generator().manual_seed(100 * call + H + Tj)
                q, k, v, jq, jk, jv, mask = layer_inputs(g, B, H, Hkv, L, Tj, D, dtype, masked)
                kw = dict(joint_query=jq, joint_key=jk, joint_value=jv, joint_strategy="rear") if Tj else {}
                if masked:
                    kw["key_mask"] = mask
                ctx.reset_stats()
                o = ctx.attention(q[:, :, mine], k[:, :, mine], v[:, :, mine], **kw)
                ref = rank_rows(q.double(), k.double(), v.double(), rank, world,
                                (jq.double(), jk.double(), jv.double()) if Tj else None, "rear",
                                key_mask=mask)
                errs.append(max_abs_err(o, ref))
                bounds.append(ref.abs().max().item())
                st = ctx.stats()
                bytes_.append((st["intra_node_bytes"], st["inter_node_bytes"], st["transfers"],
                               st["barriers"], st["grouped_exchanges"]))
            impl = ctx._impl
            caches = _caches(impl)
            out.append({
                "case": (strategy, H, Hkv, Tj, masked, str(dtype), options), "errs": errs,
                "bound": max(bounds), "bytes": bytes_, "graphs": plan_stats(impl)["graphs_captured"],
                "replays": cc.STATS.replays - before[0],
                "violations": cc.STATS.violations[len(before[1]):],
                "failures": [str(c.failure) for c in ctx._comms if c.failure is not None],
                "padded": isinstance(impl, PaddedAttention) or any(
                    isinstance(c, PaddedAttention) for c in getattr(impl, "plan_children", list)()),
                "wired": [(sorted(map(id, c.comms)) == sorted(map(id, owner.comms)), c.graphs)
                          for owner, c in caches],
                "ran": ctx.strategy})
    return out


def _caches(strategy) -> list[tuple]:
    """``(strategy, its PlanCache)`` for ``strategy`` and every strategy it holds."""
    found = []
    cache = getattr(strategy, "plans", None)
    if isinstance(cache, PlanCache):
        found.append((strategy, cache))
    for child in getattr(strategy, "plan_children", list)():
        found += _caches(child)
    return found


def _check(results: list[list[dict]], topo: str, env_graphs: bool = True) -> None:
    for rank, rows in enumerate(results):
        for r in rows:
            where = (topo, rank, r["case"])
            strategy, H, _, _, _, dtype, options = r["case"]
            graphs = options.get("cuda_graphs", True)
            graphs = env_graphs if graphs is None else graphs
            assert not r["violations"] and not r["failures"], (where, r["violations"], r["failures"])
            if options.get("fp8_comms"):
                assert max(r["errs"]) <= FP8_BOUND * r["bound"], (where, r["errs"])
            else:
                tol = TOL[torch.bfloat16 if "bfloat16" in dtype else torch.float32]
                assert max(r["errs"]) <= tol, (where, r["errs"])
            assert r["graphs"] == (1 if graphs else 0), where
            assert r["replays"] == (2 if graphs else 0), where
            assert r["bytes"][0] == r["bytes"][1] == r["bytes"][2], (where, r["bytes"])  # replays count
            assert r["wired"] and all(same and g is graphs for same, g in r["wired"]), (where, r["wired"])
            if H == 3 and topo == "2x2" and strategy != "auto":
                assert r["padded"], where


def test_every_strategy_replays_under_the_capture_rules_on_2x2():
    """tas, torus, swiftfusion, auto; padded heads; fp8; text; masks; GQA; graphs off."""
    _check(run_emulated(_strategies_rank, "2x2", FULL, timeout_s=300), "2x2")


@pytest.mark.parametrize("topo", ["4x2", "2x4"])
def test_the_two_sided_and_padded_strategies_replay_under_the_rules(topo):
    """The wrappers and strategies whose plans were built without communicators: tas (auto's
    usual pick) and padded heads (3 heads need padding on both)."""
    cases = [("tas", 4, 2, 5, True, torch.float32, {}), ("torus", 3, 3, 2, True, torch.float32, {}),
             ("auto", 3, 3, 0, False, torch.float32, {"external": False})]
    _check(run_emulated(_strategies_rank, topo, cases, timeout_s=300), topo)


def test_the_environment_turns_graphs_off_for_every_strategy():
    """``$SWIFTFUSION_CUDA_GRAPHS=off`` (no option given) reaches tas, the padded wrapper and
    auto's children as it reaches torus."""
    cases = [("tas", 4, 4, 0, False, torch.float32, {"cuda_graphs": None}),
             ("swiftfusion", 3, 3, 0, False, torch.float32, {"cuda_graphs": None}),
             ("auto", 4, 4, 0, False, torch.float32, {"cuda_graphs": None, "external": False})]
    results = run_emulated(_strategies_rank, "2x2", cases, timeout_s=300,
                           env={"SWIFTFUSION_CUDA_GRAPHS": "off"})
    _check(results, "2x2", env_graphs=False)


@pytest.mark.slow
@pytest.mark.parametrize("topo", ["4x2", "2x4"])
def test_every_strategy_replays_under_the_capture_rules(topo):
    _check(run_emulated(_strategies_rank, topo, FULL, timeout_s=600), topo)


def _unwired_tas_rank() -> list:
    """tas with a plan cache built as aa02bce built it (no communicators, no graphs option)."""
    cc.install()
    with sf.init_sequence_parallel("tas", 4, timeout_s=5) as ctx:
        impl = ctx._impl
        impl.plans = PlanCache(impl.layer, comms=[], graphs=None, name="tas")
        q = torch.randn(1, 4, 4, 16)
        raised = None
        try:
            for _ in range(3):
                ctx.attention(q, q, q)
            deadline = time.monotonic() + 20  # the watchdog polls the works issued while capturing
            while ctx._comms[0].failure is None and time.monotonic() < deadline:
                time.sleep(0.05)
        except Exception as exc:  # noqa: BLE001  (the finding)
            raised = f"{type(exc).__name__}: {exc}"
        violations, failure = list(cc.STATS.violations), ctx._comms[0].failure
        ctx.failed = failure is not None
    return [violations, None if failure is None else str(failure), raised]


def test_a_plan_cache_without_the_strategys_communicators_breaks_the_rules():
    """What aa02bce's tas and padded wrappers did: their communicators never knew of the
    capture, so the watchdog polled NCCL works issued while capturing (907): the
    communicator fails (on a GPU the process then ends)."""
    for violations, failure, raised in run_emulated(_unwired_tas_rank, "2x1", timeout_s=120):
        assert any("907" in v for v in violations), violations
        assert failure is not None and "907" in failure, failure


def test_no_plan_cache_without_communicators_and_graphs_option():
    """The constructor takes both as required keywords; strategies go through for_strategy."""
    import pathlib
    with pytest.raises(TypeError, match="comms"):
        PlanCache(lambda *a: None)
    src = pathlib.Path(sf.__file__).parent / "strategies"
    built = [p.name for p in src.glob("*.py") if "PlanCache(" in p.read_text() and p.name != "planned.py"]
    assert built == [], built
    uses = sorted(p.name for p in src.glob("*.py") if "PlanCache.for_strategy(self, options)" in p.read_text())
    assert uses == ["padded.py", "tas.py", "torus.py"]  # swiftfusion builds a TorusAttention


@pytest.mark.parametrize("status,refused", [("STATUS_LIMITED_MPG", True), ("STATUS_FULL_MPG", False),
                                            ("STATUS_IS_INITIALIZED", False)])
def test_nvshmem_limited_mode_refuses_capture(status, refused):
    """nvshmem4py: ``nvshmem.core.init_status()`` -> ``InitStatus`` (``nvshmemx_init_status``)."""
    import enum

    from xfuser_swiftfusion.comm.nvshmem import LIMITED_MODE, capture_refusal

    class InitStatus(enum.IntEnum):  # nvshmemx_init_status_t's values
        STATUS_NOT_INITIALIZED, STATUS_IS_BOOTSTRAPPED, STATUS_IS_INITIALIZED = 0, 1, 2
        STATUS_LIMITED_MPG, STATUS_FULL_MPG = 3, 4

    class Core:
        pass
    core = Core()
    core.InitStatus, core.init_status = InitStatus, lambda: InitStatus[status]
    assert capture_refusal(core) == (LIMITED_MODE if refused else None)
