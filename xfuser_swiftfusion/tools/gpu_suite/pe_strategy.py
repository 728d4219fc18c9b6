"""``pe-strategy``: the ``swiftfusion`` strategy across several NVSHMEM PEs on the one GPU of
this machine, at topologies ``2x1`` and ``4x1`` (one GPU per "machine": the Torus stages over
put/get, quiet and barriers on NVSHMEM; no NCCL anywhere).

Each PE is a process of its own (``pe``): the world process group on gloo (a TCP store on a
free port; CPU tensors, for the unique-id broadcast and the host-side checks only), CUDA device
0 for every PE, and ``init_sequence_parallel(STRATEGY, topology="2x1", comm="nvshmem")``
under the test configuration that lets PEs share a GPU (``SHARED_GPU_TEST_ENV``, set by the
stage). The stage (``stage``) runs them plain; where NVSHMEM refuses that (INFO rows saying
what it refused), again under a private CUDA MPS daemon (``Suite.mps``; every PE
``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` = 100 / PEs), started and stopped by the stage. On CPU
the same processes run on CPU tensors over the ``shm`` heap: the stand-in that the tests and
``scripts/gpu_image_dryrun.sh`` run.

Checks, per world and mode (``MODES``: the execution plans eagerly, and as CUDA graphs, which
must be captured on a GPU): each case of ``cases`` (bf16 and fp32, with and without text
tokens, a key-padding mask with grouped-query K/V; the graph mode the bf16 ones), ``LAYERS``
layers each, against an fp64 single-device reference computed in
every PE from the same seeded global inputs (``tools/check.py``): every PE's output within the
project's tolerance, ``ctx.strategy == "swiftfusion"``, no fallback, and the inter-machine bytes
each PE counted equal to ``predicted_bytes`` (the cost model's program). Then one fault: the
last PE SIGKILLs itself mid-layer (after barrier 1, at its first get); every other PE must end
in ``CommTimeout`` / ``PeerFailure`` naming its rank, the peer it waited on (the victim, a PE
that gave up before it, or the barrier over all ranks: NVSHMEM cannot tell which PE is missing
from a barrier) and the stage within ``FAULT_BOUND_S``, and exit; at least one names the victim. The stage's own bound on the PEs is the backstop: a PE it stops is
a FAIL row.

Strategies that exchange over NCCL (usp, tas, torus, and auto, which picks among them) cannot
run here: NCCL refuses two ranks on one GPU. One SKIP row says so.
"""
from __future__ import annotations

import itertools
import os
import re
import signal
import sys
import time
from datetime import timedelta
from typing import Any

import torch

from ..check import DTYPES, TOLERANCE, CheckCase, global_inputs, rank_call, reference_rows
from .report import RowWriter, read_rows

STAGE = "pe-strategy"
STRATEGY = "swiftfusion"          # the one-sided strategy: no NCCL at T x 1
WORLDS = (2, 4)                   # PEs on the one GPU: topologies 2x1 and 4x1
# mode -> (init_sequence_parallel keyword arguments, the dtypes it checks): the execution plans
# run eagerly, and replayed as CUDA graphs (captured at the second layer of a case, replayed
# at the third; the bf16 cases, whose triton launches a graph holds on a GPU)
MODES: dict[str, tuple[dict, tuple[str, ...]]] = {
    "eager": ({"options": {"cuda_graphs": False}}, ("bf16", "fp32")),
    "graph": ({"options": {"cuda_graphs": True}}, ("bf16",))}
HEADS, KV_HEADS, HEAD_DIM, TOKENS = 8, 2, 64, 128  # TOKENS: image tokens per PE
TEXT, MASKED = 7, 16              # text tokens; image keys masked (key padding)
LAYERS = 3                        # attention calls per case (later ones run the first's plan)
COMM_TIMEOUT_S = 30.0             # the communicator's timeout in the checked runs
FAULT_TIMEOUT_S = 3.0             # ... in the faulty layer
FAULT_BOUND_S = 2 * FAULT_TIMEOUT_S + 2.0  # a survivor's error must come within this
RUN_S, FAULT_RUN_S = 90.0, 60.0   # the stage's bound on one run of PEs (the backstop)
MIN_RUN_S = 20.0                  # a run with less time left is a SKIP row
GRACE_S = 10.0                    # PEs still running this long after one refused are stopped
NCCL_REASON = ("exchange over NCCL on a GPU (two-sided; auto picks among them), and NCCL "
               "refuses two ranks on one GPU ('Duplicate GPU detected', NCCL 2.28.9): not run "
               "with PEs sharing this GPU; the strategies stage runs them at world size 1")
STAGE_RE = re.compile(r"Ulysses scatter|Pull-Q stage|Pull-KV stage|Push-O|barrier")


def cases(world: int) -> list[tuple[str, CheckCase]]:
    """The checked cases of ``world`` PEs: ``(name, case)``, bf16 and fp32 x without / with
    text tokens x without / with a key-padding mask and grouped-query K/V."""
    out = []
    for seed, (dtype, text, masked) in enumerate(itertools.product(("bf16", "fp32"), (0, TEXT),
                                                                   (False, True))):
        name = dtype + (f" text {text}" if text else "") + (f" mask {MASKED} GQA {KV_HEADS}" if masked else "")
        out.append((name, CheckCase(heads=HEADS, seq_len=TOKENS * world, head_dim=HEAD_DIM,
                                    dtype=dtype, joint_tokens=text,
                                    joint_strategy="rear" if masked else "front", seed=seed,
                                    heads_kv=KV_HEADS if masked else 0,
                                    masked_keys=MASKED if masked else 0)))
    return out


def mode_cases(world: int, mode: str) -> list[tuple[str, CheckCase]]:
    """The cases ``mode`` checks (``MODES``)."""
    return [(n, c) for n, c in cases(world) if c.dtype in MODES[mode][1]]


def expected_passes(world: int) -> int:
    """PASS rows of a run of ``world`` PEs where every case of every mode passes."""
    return sum(len(mode_cases(world, m)) for m in MODES)


def predicted_bytes(mesh: Any, rank: int, case: CheckCase) -> int:
    """Inter-machine bytes of one layer of ``case`` on ``rank``: what the cost model counts,
    the strategy's program (``strategies/ops.py``) for B, S, H, D and the text tokens, with the
    K/V of grouped-query attention moving ``H_kv' = lcm(H_kv, T*U)`` heads instead of ``H``
    (the program's shape has no K/V heads): ``(T-1) U`` Pull-KV gets of K and V per layer."""
    from ...strategies import get
    from ...strategies.layout import kv_heads_for
    from ...strategies.ops import Shape, sent_bytes
    S = case.seq_len // mesh.world_size
    shape = Shape(case.batch, S, case.heads, case.head_dim, case.joint_tokens,
                  DTYPES[case.dtype].itemsize)
    node = mesh.topology.node_of
    far = {p for p in range(mesh.world_size) if node(p) != node(rank)}
    model = sent_bytes(get(STRATEGY).program(mesh, rank, shape), far)
    G = mesh.torus * mesh.ulysses_intra
    h, h_kv = case.heads // G, kv_heads_for(case.heads, case.kv_heads, G) // G
    return model - (mesh.torus - 1) * mesh.ulysses_intra * 2 * shape.nbytes(h - h_kv, S)


def is_refusal(exc: BaseException) -> bool:
    """An error of NVSHMEM or CUDA (their modules' exceptions, a CUDA error), or a timeout /
    peer failure of the communicator (NVSHMEM not progressing): what a configuration NVSHMEM
    does not support shows as. Anything else (a wrong argument, our own checks) is not."""
    from ...comm import CommTimeout, PeerFailure
    seen: BaseException | None = exc
    for _ in range(8):  # the cause chain
        if seen is None:
            return False
        if (type(seen).__module__.split(".")[0] in ("nvshmem", "cuda")
                or isinstance(seen, (CommTimeout, PeerFailure)) or "CUDA error" in str(seen)):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def peers_named(text: str, rank: int) -> set:
    """The peers an error ``text`` of ``rank`` names: ranks, or ``"all"`` for a barrier over
    all ranks (NVSHMEM's barriers cannot tell which PE is missing)."""
    found: set = {int(n) for n in re.findall(r"\b(?:peer|rank) (?:rank )?(\d+)\b", text)}
    found |= {int(n) for group in re.findall(r"peers \[([\d, ]+)\]", text) for n in group.split(",")}
    found.discard(rank)
    return found | ({"all"} if "over all ranks" in text else set())


def fault_named(text: str, rank: int, typed: bool = True) -> list[str]:
    """What a survivor's error ``text`` fails to name of: the error type (CommTimeout or
    PeerFailure; not with ``typed=False``: the watchdog's last message has no type), its rank,
    a peer (the one it waited on: the victim, a PE that gave up before it, or a barrier over all
    ranks) and the stage."""
    missing = []
    if typed and not re.search(r"\b(CommTimeout|PeerFailure)\b", text):
        missing.append("CommTimeout/PeerFailure")
    if f"rank {rank}:" not in text:
        missing.append(f"rank {rank}")
    if not peers_named(text, rank):
        missing.append("a peer")
    if not STAGE_RE.search(text):
        missing.append("stage")
    return missing


# -- one PE ------------------------------------------------------------------------------------

def _comms(ctx: Any) -> list:
    return ctx._comms  # the strategy's communicators (their ``failure``: the watchdog's finding)


def wait_for_device(ctx: Any, device: torch.device, bound_s: float) -> None:
    """Wait, on the host, for the GPU work queued so far, without blocking in CUDA: raise the
    communicator's failure as soon as its watchdog records one (a kernel waiting on a dead PE
    never finishes), or ``CommTimeout`` after ``bound_s``. On CPU: only where the capture
    stand-in replays graphs (its device), else a no-op."""
    from ...comm import CommTimeout
    from ...strategies import planned
    if not planned.graph_device(device):
        return
    event = torch.cuda.Event()
    event.record()
    deadline = time.monotonic() + bound_s
    while not event.query():
        failure = next((c.failure for c in _comms(ctx) if getattr(c, "failure", None)), None)
        if failure is not None:
            raise type(failure)(f"{ctx.strategy}: {failure}")
        if time.monotonic() > deadline:
            raise CommTimeout(f"rank {ctx.rank}: the layer's GPU work did not finish within "
                              f"{bound_s:.0f} s and no communicator reported a failure")
        time.sleep(1e-3)


STAND_IN_LIMITED_ENV = "SWIFTFUSION_STAND_IN_LIMITED_MPG"
"""Set (to 1) on CPU: the stand-in's heap acts as NVSHMEM's limited multi-process mode, unless
the PEs run under MPS (``CUDA_MPS_PIPE_DIRECTORY`` set), as NVSHMEM does."""


def stand_in(device: torch.device) -> None:
    """On CPU, CUDA's capture rules (``emulation/cuda_capture.py``): the graph mode captures
    and replays there too, and breaks where a GPU would."""
    if device.type == "cuda":
        return
    from ...emulation import cuda_capture
    cuda_capture.install(limited_mpg=os.environ.get(STAND_IN_LIMITED_ENV) == "1"
                         and not os.environ.get("CUDA_MPS_PIPE_DIRECTORY"))


def _one_case(ctx: Any, case: CheckCase, rank: int, world: int, device: torch.device) -> dict:
    """``LAYERS`` calls of ``case`` on this PE: its worst error against the reference, the
    bytes it counted and those predicted, or the error it raised."""
    x = global_inputs(case, device)
    local, kwargs = rank_call(x, case, rank, world)
    ref = reference_rows(x, case, rank, world)
    ctx.reset_stats()
    graphs = ctx.stats()["graphs_captured"]  # counted since init: this case's are the new ones
    worst = 0.0
    try:
        for _ in range(LAYERS):
            out = ctx.attention(*local, **kwargs)
            wait_for_device(ctx, device, COMM_TIMEOUT_S)
            if out.shape != ref.shape:
                raise AssertionError(f"output {tuple(out.shape)}, expected {tuple(ref.shape)}")
            err = (out.double() - ref).abs().max().item()
            worst = err if err != err or err > worst else worst  # NaN stays
        stats = ctx.stats()
    except Exception as exc:  # noqa: BLE001  (reported in the case's row)
        return {"error": f"{type(exc).__name__}: {exc}"[:300], "refusal": is_refusal(exc)}
    return {"error": None, "err": worst, "bytes": stats["inter_node_bytes"],
            "predicted": LAYERS * predicted_bytes(ctx.mesh, rank, case),
            "strategy": ctx.strategy, "fallbacks": stats["fallbacks"],
            "graphs": stats["graphs_captured"] - graphs}


def _verdict(every: list[dict], tol: float) -> list[str]:
    """What is wrong, PE by PE (nothing: the case passed)."""
    wrong = []
    for r, o in enumerate(every):
        if o["error"]:
            wrong.append(f"rank {r}: {o['error']}")
            continue
        if not o["err"] <= tol:  # NaN too
            wrong.append(f"rank {r}: max abs err {o['err']:.2e} > {tol:g}")
        if o["strategy"] != STRATEGY:
            wrong.append(f"rank {r}: ran as {o['strategy']}")
        if o["fallbacks"]:
            wrong.append(f"rank {r}: fallbacks {o['fallbacks']}")
        if o["bytes"] != o["predicted"]:
            wrong.append(f"rank {r}: {o['bytes']} inter-machine bytes, the model {o['predicted']}")
    return wrong


def _run_cases(w: RowWriter, rank: int, world: int, device: torch.device, label: str,
               comm: str) -> bool:
    """Every mode and case; rank 0 writes one row per case (every PE's figures gathered over
    gloo). Stops at the first case that fails. Returns whether every case passed."""
    import torch.distributed as dist
    from ...context import init_sequence_parallel
    from ...strategies import planned
    topo, suffix = f"{world}x1", "" if label == "plain" else f" under {label}"
    note = "" if device.type == "cuda" else " (CPU stand-in: shm heap, CUDA capture rules)"
    tags = {"attempt": label, "world": world, "stand_in": device.type != "cuda"}
    stand_in(device)
    passed = 0
    for mode, (options, _) in MODES.items():
        try:
            ctx = init_sequence_parallel(STRATEGY, HEADS, topo, timeout_s=COMM_TIMEOUT_S,
                                         comm=comm, **options)
        except Exception as exc:  # noqa: BLE001  (what NVSHMEM refuses is the finding)
            refused = not passed and is_refusal(exc)
            w.add(f"{topo} {mode}{suffix} (rank {rank})", "INFO" if refused else "FAIL",
                  f"init_sequence_parallel: {type(exc).__name__}: {exc}"[:400], refused=refused,
                  rank=rank, **tags)
            return False
        refused_by = next((c.capture_refused for c in _comms(ctx) if c.capture_refused), None)
        if mode == "graph" and refused_by:  # NVSHMEM's limited mode: MPS is tried next
            ctx.close()
            if rank == 0:
                w.add(f"{topo} {mode}{suffix}", "INFO", f"not captured: {refused_by}"[:400],
                      refused=True, **tags)
            return False
        try:
            for name, case in mode_cases(world, mode):
                mine = _one_case(ctx, case, rank, world, device)
                if mode == "graph" and planned.graph_device(device) and mine["error"] is None \
                        and mine["graphs"] < 1:
                    mine["error"] = ("its plan was not captured in a CUDA graph (the log of this "
                                     "PE says why)")
                every: list = [None] * world
                try:
                    dist.all_gather_object(every, mine)
                except Exception as exc:  # noqa: BLE001  (a PE is gone)
                    w.add(f"{topo} {name} {mode}{suffix} (rank {rank})", "FAIL", f"{mine['error'] or 'ok'}; "
                          f"then the gather of the PEs' figures failed: {exc}"[:400], rank=rank, **tags)
                    ctx.failed = True
                    return False
                tol = TOLERANCE[DTYPES[case.dtype]]
                wrong = _verdict(every, tol)
                refused = bool(wrong) and not passed and any(o.get("refusal") for o in every)
                if rank == 0:
                    case_name = f"{topo} {name} {mode}{suffix}"
                    if wrong:
                        w.add(case_name, "INFO" if refused else "FAIL", "; ".join(wrong)[:400],
                              refused=refused, **tags)
                    else:
                        err = max(o["err"] for o in every)
                        w.add(case_name, "PASS", f"{world} PEs: max abs err {err:.1e} (tol {tol:g}); "
                              f"{every[0]['bytes']} inter-machine bytes per PE over {LAYERS} layers "
                              f"= the model; swiftfusion, no fallback{note}", err=err,
                              bytes=[o["bytes"] for o in every], **tags)
                if wrong:
                    ctx.failed = True
                    return False
                passed += 1
        finally:
            ctx.close()
    return True


def _arm_kill(ctx: Any, device: torch.device) -> None:
    """This PE SIGKILLs itself at its first get of the next layer: mid-layer, once barrier 1
    (after the intra-machine scatter) has completed on every PE (waited for at most the
    timeout). The layer's gets are prepared anew for that (its plan is compiled again)."""
    comm = _comms(ctx)[0]
    prepare = comm.prepare

    def prepare_to_die(op: str, *args: Any, **kwargs: Any):
        issue = prepare(op, *args, **kwargs)
        if op != "get":
            return issue

        def get_then_die() -> None:
            if device.type == "cuda":
                event = torch.cuda.Event()
                event.record()
                deadline = time.monotonic() + FAULT_TIMEOUT_S
                while not event.query() and time.monotonic() < deadline:
                    time.sleep(1e-3)
            print(f"pe-strategy: rank {ctx.rank}: SIGKILL mid-layer (after barrier 1, at its "
                  "first get)", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return get_then_die

    comm.prepare = prepare_to_die
    ctx._impl.plans._plans.clear()  # the next call compiles the layer, with these gets


def _run_fault(w: RowWriter, rank: int, world: int, device: torch.device, label: str,
               comm: str) -> None:
    """A layer with a long timeout (kernels compiled), one with ``FAULT_TIMEOUT_S`` (buffers
    allocated), then up to three where the last PE kills itself: every other PE writes a row
    with how its calls ended."""
    from ...context import init_sequence_parallel
    topo, victim = f"{world}x1", world - 1
    case_name = f"{topo} PE {victim} SIGKILLed mid-layer" + ("" if label == "plain" else f" under {label}")
    tags = {"attempt": label, "world": world, "fault": True, "rank": rank,
            "stand_in": device.type != "cuda"}
    _, case = cases(world)[0]
    stand_in(device)
    x = global_inputs(case, device)
    local, kwargs = rank_call(x, case, rank, world)
    try:
        with init_sequence_parallel(STRATEGY, HEADS, topo, timeout_s=COMM_TIMEOUT_S, comm=comm) as warm:
            warm.attention(*local, **kwargs)
            wait_for_device(warm, device, COMM_TIMEOUT_S)
        ctx = init_sequence_parallel(STRATEGY, HEADS, topo, timeout_s=FAULT_TIMEOUT_S, comm=comm,
                                     options={"cuda_graphs": True})
        limited = next((c.capture_refused for c in _comms(ctx) if c.capture_refused), None)
        if limited:  # barriers are host spins holding the GIL there: no watchdog could run
            raise RuntimeError(f"the fault run needs barriers that are kernels (MPS or one PE "
                               f"per GPU): {limited}")
        for _ in range(2):  # eager, then captured: the survivors replay in the faulty layers
            ctx.attention(*local, **kwargs)
            wait_for_device(ctx, device, COMM_TIMEOUT_S)
        if ctx.stats()["graphs_captured"] != 1:
            raise RuntimeError("the layer was not captured in a CUDA graph (this PE's log says why)")
    except Exception as exc:  # noqa: BLE001
        w.add(f"{case_name} (rank {rank})", "FAIL", f"the layers before the fault failed: "
              f"{type(exc).__name__}: {exc}"[:400], **tags)
        return
    if rank == victim:
        _arm_kill(ctx, device)
    t0 = time.monotonic()
    outcome: BaseException | None = None
    try:
        for _ in range(3):  # a PE that needs nothing more from the victim in one layer fails in the next
            ctx.attention(*local, **kwargs)
            wait_for_device(ctx, device, FAULT_BOUND_S)
    except Exception as exc:  # noqa: BLE001  (the outcome is the finding)
        outcome = exc
        ctx.failed = True  # no final barrier: the peers are mid-layer or gone
    seconds = time.monotonic() - t0
    ctx.close()
    text = "" if outcome is None else f"{type(outcome).__name__}: {outcome}"
    missing = fault_named(text, rank) if outcome is not None else ["an error"]
    late = seconds > FAULT_BOUND_S
    w.check(f"{case_name} (rank {rank})", not missing and not late,
            (f"returned after {seconds:.1f} s" if outcome is None else f"{seconds:.1f} s: {text}")
            + (f" [does not name: {', '.join(missing)}]" if missing and outcome is not None else "")
            + (f" [later than {FAULT_BOUND_S:.0f} s]" if late else ""), seconds=seconds,
            message=text[:1000], **tags)


def pe(w: RowWriter, rank: int, world: int, port: int, label: str, fault: bool) -> int:
    """One PE of ``world`` on GPU 0 (or on CPU: the stand-in): the cases, or the fault.
    NVSHMEM is finalized at a normal exit; after a failure the process ends without it (a
    kernel waiting on a dead PE never finishes)."""
    import torch.distributed as dist
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=RUN_S))
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        from ...comm.nvshmem import nvshmem_import_error
        error = nvshmem_import_error()
        if error is not None:
            if rank == 0:
                w.add(f"{world}x1 ({label})", "SKIP", f"nvshmem.core does not import: {error}"[:300],
                      attempt=label, world=world, skip=True)
            return 0
    comm = "nvshmem" if cuda else "shm"
    if fault:
        _run_fault(w, rank, world, device, label, comm)
    elif _run_cases(w, rank, world, device, label, comm):
        dist.destroy_process_group()
        return 0
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# -- the stage (the suite's process) -----------------------------------------------------------

def _new_rows(suite: Any, before: int, **match: Any) -> list:
    return [r for r in read_rows(suite.rows_path)[before:] if r.stage == STAGE
            and all(r.data.get(k) == v for k, v in match.items())]


def _nvshmem_messages(outputs: list[str]) -> str:
    """NVSHMEM's own warnings in the PEs' output (limited mode, MPS), deduplicated."""
    lines = dict.fromkeys(line.strip() for out in outputs for line in out.splitlines()
                          if re.search(r"(?i)nvshmem", line)
                          and re.search(r"(?i)warn|limited|mps|mpg|not supported", line))
    return " / ".join(list(lines)[:3])


def _run(suite: Any, world: int, label: str, env: dict, end: float) -> str:
    """One run of the cases on ``world`` PEs: ``"passed"``, ``"refused"`` (NVSHMEM refused:
    INFO rows), ``"skipped"`` (budget, or nvshmem.core does not import) or ``"failed"``."""
    suffix = "" if label == "plain" else f" under {label}"
    left = end - time.monotonic()
    if left < MIN_RUN_S:
        suite.add(STAGE, f"{world}x1{suffix}", "SKIP", f"budget: {max(0.0, left):.0f} s left")
        return "skipped"
    before = len(read_rows(suite.rows_path))
    timeout_s = min(RUN_S, left)
    refused = lambda: bool(_new_rows(suite, before, refused=True, world=world))  # noqa: E731
    results = suite.pes(STAGE, label, world, env, timeout_s=timeout_s,
                        give_up=refused, grace_s=GRACE_S)
    gave_up = refused()
    for r, (rc, out) in enumerate(results):
        tail = " / ".join(line.strip() for line in out.strip().splitlines()[-3:])
        if rc is None:
            suite.add(STAGE, f"{world}x1{suffix} (rank {r})", "INFO" if gave_up else "FAIL",
                      (f"stopped {GRACE_S:.0f} s after a PE refused" if gave_up else
                       f"stopped by the stage's bound after {timeout_s:.0f} s (the backstop)")
                      + f": {tail}"[:300], attempt=label, world=world, refused=gave_up)
        elif rc:
            suite.add(STAGE, f"{world}x1{suffix} (rank {r})", "FAIL", f"exit {rc}: {tail}"[:400],
                      attempt=label, world=world)
    said = _nvshmem_messages([out for _, out in results])
    if said:
        suite.add(STAGE, f"{world}x1{suffix} NVSHMEM's messages", "INFO", said[:400],
                  attempt=label, world=world)
    rows = _new_rows(suite, before, attempt=label, world=world)
    if any(r.data.get("skip") for r in rows):
        return "skipped"
    if any(r.data.get("refused") for r in rows):
        return "refused"
    passed = [r for r in rows if r.result == "PASS"]
    ok = (len(passed) == expected_passes(world) and not any(r.result == "FAIL" for r in rows)
          and all(rc == 0 for rc, _ in results))
    return "passed" if ok else "failed"


def _fault(suite: Any, world: int, label: str, env: dict, end: float) -> None:
    """The fault run on ``world`` PEs: the victim's row (it died of SIGKILL as planned) and, for
    a survivor that wrote none, one from how its process ended (the communicator's watchdog
    ends a process whose host thread is stuck: its message counts if it names what it must)."""
    suffix = "" if label == "plain" else f" under {label}"
    victim = world - 1
    case = f"{world}x1 PE {victim} SIGKILLed mid-layer{suffix}"
    left = end - time.monotonic()
    if left < MIN_RUN_S:
        suite.add(STAGE, case, "SKIP", f"budget: {max(0.0, left):.0f} s left")
        return
    before = len(read_rows(suite.rows_path))
    timeout_s = min(FAULT_RUN_S, left)
    results = suite.pes(STAGE, label, world, env, ("--fault",), timeout_s=timeout_s)
    tags = {"attempt": label, "world": world, "fault": True}
    rc = results[victim][0]
    if rc == -signal.SIGKILL and "SIGKILL mid-layer" in results[victim][1]:
        suite.add(STAGE, f"{case} (rank {victim})", "INFO", "killed itself as planned (exit -9)",
                  rank=victim, **tags)
    elif not _new_rows(suite, before, rank=victim, fault=True):
        suite.add(STAGE, f"{case} (rank {victim})", "FAIL", f"the fault was not injected: exit {rc}",
                  rank=victim, **tags)
    texts = {}
    for r, (rc, out) in enumerate(results):
        own = _new_rows(suite, before, rank=r, fault=True)
        if r == victim or own:
            texts[r] = " ".join(row.data.get("message", "") for row in own)
            continue  # the PE's own row
        if rc is None:
            suite.add(STAGE, f"{case} (rank {r})", "FAIL", f"still running after {timeout_s:.0f} s: "
                      "stopped by the stage's bound (the backstop)", rank=r, **tags)
            continue
        said = re.search(r"xfuser_swiftfusion: (rank \d+: .*)", out)
        text = said.group(1) if said else " / ".join(out.strip().splitlines()[-2:])
        texts[r] = text if said else ""
        missing = fault_named(text, r, typed=False) if said else ["a message"]
        suite.add(STAGE, f"{case} (rank {r})", "PASS" if not missing else "FAIL",
                  f"exit {rc}, ended by the communicator's watchdog: {text}"[:400] if said else
                  f"exit {rc} without a row: {text}"[:400], rank=r, **tags)
    naming = sorted(r for r, t in texts.items() if r != victim and peers_named(t, r) & {victim, "all"})
    suite.add(STAGE, f"{case}: the victim named", "PASS" if naming else "FAIL",
              f"ranks {naming} name rank {victim} (or the barrier over all ranks)" if naming else
              f"no PE's error names rank {victim} or a barrier over all ranks", **tags)


def stage(suite: Any, timeout_s: float) -> None:
    """The stage in the suite's (``Suite``) process, within ``timeout_s`` and the budget."""
    from ...strategies import specs
    end = min(time.monotonic() + timeout_s, suite.deadline)
    others = [s.name for s in specs() if not s.one_sided]  # two-sided: NCCL on a GPU
    suite.add(STAGE, ", ".join(others), "SKIP", NCCL_REASON)
    env = dict(suite.env, **{_shared_gpu_env(): "1"})
    status: dict[tuple[str, int], str] = {}
    for world in WORLDS:
        if world != WORLDS[0] and status[("plain", WORLDS[0])] != "passed":
            suite.add(STAGE, f"{world}x1", "SKIP", f"{WORLDS[0]} PEs did not pass plain")
            status[("plain", world)] = status[("plain", WORLDS[0])]
            continue
        status[("plain", world)] = _run(suite, world, "plain", env, end)
    passed = [w for w in WORLDS if status[("plain", w)] == "passed"]
    if passed:
        _fault(suite, max(passed), "plain", env, end)
    again = [w for w in WORLDS if status[("plain", w)] == "refused"]
    if again:
        with suite.mps(STAGE, "under MPS") as mps_env:
            if mps_env is not None:
                mps_env = dict(mps_env, **{_shared_gpu_env(): "1"})
                for world in again:
                    status[("MPS", world)] = _run(suite, world, "MPS", mps_env, end)
                under = [w for w in again if status[("MPS", w)] == "passed"]
                if under and not passed:
                    _fault(suite, max(under), "MPS", mps_env, end)
    if not any(s == "passed" for s in status.values()):
        suite.add(STAGE, "(stage)", "INFO", "swiftfusion did not run on several PEs of this GPU: "
                  + ", ".join(f"{w} PEs {m}: {s}" for (m, w), s in status.items()))


def _shared_gpu_env() -> str:
    from ...comm.nvshmem import SHARED_GPU_TEST_ENV
    return SHARED_GPU_TEST_ENV
