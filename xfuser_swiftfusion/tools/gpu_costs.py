"""What this code costs on a GPU, from a GPU suite run (``swiftfusion check --gpu-suite``):
the costs file of the built-in GPU profiles (``hardware.gpu_costs``: ``gpu_costs.json`` in
the package), and the replay's prediction that holds those costs to the run.

A run (``benchmarks/gpu/<run>/rows.jsonl``) has, besides its environment:

- the speed stage: per launch shape of the Torus schedule (``n`` Q chunks x ``U`` K/V chunks
  of S rows, h heads) and per backend, the kernel alone (CUDA graph: GPU time) and
  ``attend`` called back to back (its host work included);
- the replay stage: rank 0's ``swiftfusion`` layer of 4 x 8 on one GPU, every transfer a
  device-to-device copy (``gpu_suite/replay.py``): GPU time and host (issue) time per layer,
  its attend calls.

Derived from them (``derive``), for the backend the replay timed (the fastest):

- ``attention``: the kernel's FLOP/s per launch shape, ``(sum Lq, sum Lk, FLOP/s)`` per dtype
  and head dim (the profile interpolates between shapes, log-log, clamped at the edges);
- ``merge_call_s``, host per query chunk of an attend call: between a model's two launch
  shapes (the same K/V, n and 4n Q chunks) ``attend``'s time per call grows by the host's
  work for the extra chunks plus the kernels' difference (the host is the bound where a call
  takes >= 2x its kernel); the mean over the models where both shapes are host-bound;
- ``attend_call_s``, ``transfer_call_s``, host per attend call and per transfer: the
  replay's host time per layer less ``merge_call_s`` per query chunk, least squares (relative
  error) over the models' layers, whose calls and transfers are rank 0's program
  (``replay_program``);
- ``chunk_s``, device time per query chunk of an attend call beyond its FLOPs (state
  creation, merge and finalization launches, the gaps between launches): least squares
  (relative) of the replay's GPU time per layer against the timeline of rank 0's program in
  the replay's world (``replay_profile``) without it.

The host figures belong to the code at the run's commit (they change with it); the file
records the run. The baseline (``usp``: xFuser's code makes its calls, not ours) has its own
compute: ``USP_MEASURED`` (four cuDNN calls with log-sum-exp and torch's sigmoid/logsigmoid
merge on an H100) until a committed run has USP's row.

``check_replay``: the timeline of rank 0's program on ``replay_profile`` against every replay
row (GPU time with the host ahead, host time), the check ``tests/test_gpu_costs.py`` holds.

``advice_table``: what ``plan`` predicts for the replay's models on the measured ``p5`` and
``p4de``, the table docs/cost-model.md shows (tests/test_gpu_costs.py checks
it does, and that ``plan`` prints the same).

Command (CPU only, reads the run's rows; ``--advice``: the table too):
    python -m xfuser_swiftfusion.tools.gpu_costs benchmarks/gpu/h100-6230d7a [--advice]
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
from dataclasses import replace
from pathlib import Path

from ..hardware import (GPU_COSTS_FORMAT, GPU_COSTS_PATH, MACHINES, HardwareProfile, Rate,
                        measured_gpu_profile, table_to_json)
from ..mesh import torus_mesh
from ..strategies.ops import KINDS, Attend, Op, Shape, Transfer
from ..strategies.registry import modelled, specs
from ..timeline import simulate_alone
from ..topology import Topology
from .gpu_suite.kernel import MODELS, ModelShape

# The launch mode of the Torus strategies' programs in a run whose replay rows do not name it
# (runs before execution plans: one attend call per ring step, 44 per Flux layer, 29 per
# CogVideoX layer); a newer run's rows carry it (``launch_mode``).
DEFAULT_LAUNCHES = "ring"
# The replay variant whose costs the profiles take from a run that has several (its rows'
# ``variant``): the layer as users run it on CUDA.
PRODUCTION_VARIANT = "plan + CUDA graph"

USP_MEASURED = {
    "how": ("measured: xFuser 0.7's USP compute on rank 0 of 4 x 8 (Ulysses 8 inside, ring 4 "
            "across): four cuDNN calls with log-sum-exp and torch's sigmoid/logsigmoid merge, GPU "
            "time from a CUDA graph, host time with a sleep kernel ahead; NVIDIA H100 80GB HBM3 at "
            "d9f1c9e (issue 38, DESIGN.md section 7); xFuser's collectives' host cost not "
            "measured: 0"),
    "rows": [  # per model: heads, queries, keys of rank 0's calls; their GPU and host time
        {"model": "Flux 3072px", "heads": 3, "queries": 9344, "keys": 37376, "head_dim": 128,
         "calls": 4, "gpu_ms": 1.10, "host_ms": 0.61},
        {"model": "Flux 4096px", "heads": 3, "queries": 16512, "keys": 66048, "head_dim": 128,
         "calls": 4, "gpu_ms": 2.92, "host_ms": 0.67},
        {"model": "CogVideoX-5B", "heads": 6, "queries": 4444, "keys": 17776, "head_dim": 64,
         "calls": 4, "gpu_ms": 0.47, "host_ms": 0.71},
    ],
}
HOST_BOUND = 2.0  # a launch whose attend call takes this many times its kernel: host-bound


def load_rows(path: Path) -> list[dict]:
    """The rows of a JSON-lines file, or of a run's folder (its ``rows.jsonl``)."""
    path = Path(path)
    path = path / "rows.jsonl" if path.is_dir() else path
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_info(run: Path, rows: list[dict]) -> dict:
    """The run the costs come from: its folder, GPU, commit and date (the folder's README,
    first lines: ``... at <commit>``, the command's date) and library versions."""
    readme = (Path(run) / "README.md").read_text()
    commit = re.search(r"\bat ([0-9a-f]{7,40})\b", readme.splitlines()[0])
    date = re.search(r"\d{4}-\d{2}-\d{2}( \d{2}:\d{2} UTC)?", readme)
    if not commit or not date:
        raise ValueError(f"{run}/README.md does not name the run's commit ('... at <commit>' on "
                         "its first line) and date")
    env = {r["case"]: r["data"] for r in rows if r["stage"] == "env"}
    gpu, pkgs = env.get("gpu", {}), env.get("packages", {})
    versions = {k: pkgs[k] for k in ("torch", "triton", "nvidia-cudnn-cu13", "nvshmem4py-cu13") if k in pkgs}
    versions |= {"cuda": gpu.get("cuda"), "driver": gpu.get("driver")}
    return {"dir": _rel(run), "gpu": gpu.get("name", "?"), "sm": gpu.get("sm"),
            "commit": commit.group(1), "date": date.group(0), "versions": versions}


def _rel(run: Path) -> str:
    parts = Path(run).resolve().parts
    return "/".join(parts[parts.index("benchmarks"):]) if "benchmarks" in parts else str(run)


def replay_program(model: ModelShape, launches: str = DEFAULT_LAUNCHES, nodes: int = 4,
                   gpus: int = 8) -> list[Op]:
    """Rank 0's ``swiftfusion`` program for ``model`` on ``nodes`` x ``gpus`` as the replay
    executes its layer (``replay.build_layer``): the mesh and heads of ``torus_mesh``, S =
    ceil(image tokens / W) rows per rank, the text tokens as joint tensors where the model
    passes them so; ``launches``: the run's launch mode. The one place the replay's program
    is built (the checks assert its attend calls are the run's)."""
    topo = Topology(nodes, gpus)
    mesh, heads = torus_mesh(topo, model.heads)
    S = -(-(model.tokens - model.joint) // topo.world_size)
    shape = Shape(1, S, heads, model.head_dim, model.joint, 2)
    return _swiftfusion().program(mesh, 0, shape, launches=launches)


def _swiftfusion():
    """The one-sided Torus strategy the replay runs (``OneSidedTorusIO``)."""
    return next(s for s in specs() if s.one_sided and s.needs_torus)


def attend_calls(ops: list[Op]) -> int:
    return sum(isinstance(op, Attend) for op in ops)


def _counts(ops: list[Op]) -> tuple[int, int, int]:
    """(attend calls, query chunks of those calls, transfers) of a program."""
    return (attend_calls(ops), sum(len(op.q) for op in ops if isinstance(op, Attend)),
            sum(isinstance(op, Transfer) for op in ops))


def _dtype(row: dict) -> str:
    return row["data"]["shape"].split("/")[1]


def speed_rows(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["stage"] == "speed" and r["result"] == "INFO" and "launch" in r["data"]]


def replay_rows(rows: list[dict], models=MODELS) -> dict[str, dict]:
    """Per model, the replay row that timed host and GPU (``host_ms``) of our layer: of the
    backend the speed stage found fastest in bf16 (the replay's dtype) where several did, and,
    in a run whose rows name variants, the one users run (``PRODUCTION_VARIANT``, else the
    eager plan); xFuser's USP row is not ours (``usp_rows``)."""
    fastest = statistics.mode(r["data"]["fastest"] for r in speed_rows(rows) if _dtype(r) == "bf16")
    out: dict[str, dict] = {}
    for m in models:
        timed = [r["data"] for r in rows if r["stage"] == "replay" and r["case"].startswith(f"{m.name} rank 0")
                 and r["data"].get("host_ms") is not None and not r["data"].get("usp")]
        named = [d for v in (PRODUCTION_VARIANT, "plan") for d in timed if d.get("variant") == v]
        timed = named or timed
        if timed:
            out[m.name] = next((d for d in timed if d["backend"] == fastest), timed[0])
    return out


def usp_rows(rows: list[dict], models=MODELS) -> dict | None:
    """xFuser's USP on the replay's rank (the replay's ``USP`` row, where the run has one) in
    ``USP_MEASURED``'s form, else None."""
    found = []
    for m in models:
        row = next((r for r in rows if r["stage"] == "replay" and r["case"].startswith(f"{m.name} rank 0")
                    and r["data"].get("usp") and r["data"].get("host_ms") is not None), None)
        if row is None:
            continue
        d = row["data"]
        W, U, R = 32, d["U"], d["R"]
        S = -(-(m.tokens - m.joint) // W)
        queries = U * (S + m.joint)  # xFuser concatenates the text before the all-to-all
        found.append({"model": m.name, "heads": m.heads // U, "queries": queries,
                      "keys": R * U * S + m.joint, "head_dim": m.head_dim, "calls": R,
                      "gpu_ms": d.get("attention_gpu_ms", d["gpu_ms"]), "host_ms": d["host_ms"]})
    if not found:
        return None
    return {"how": ("measured: the run's replay of xFuser 0.7's USP on rank 0 of 4 x 8 (Ulysses "
                    "inside, ring across: one attention call with log-sum-exp per ring block and "
                    "torch's merge, GPU time of those alone; host time of the whole layer, its "
                    "all-to-alls as device copies; gpu_suite/usp_layer.py)"),
            "rows": found}


def kernel_table(speed: list[dict], backend: str) -> dict:
    """``{dtype: {D: [(sum Lq, sum Lk, FLOP/s), ...]}}`` of ``backend``'s kernel (CUDA graph),
    where it ran the launch, else of the launch's fastest backend (a dtype it does not take)."""
    table: dict = {}
    for r in speed:
        d = r["data"]
        name = backend if backend in d["kernel_ms"] else d["fastest"]
        L = d["launch"]
        pt = (sum(L["q_lens"]), sum(L["kv_lens"]), d["flops"] / (d["kernel_ms"][name] * 1e-3))
        table.setdefault(_dtype(r), {}).setdefault(L["head_dim"], []).append(pt)
    return {dt: {D: tuple(sorted(p)) for D, p in t.items()} for dt, t in table.items()}


def merge_host_s(speed: list[dict], backend: str) -> tuple[float, str]:
    """Host seconds per query chunk of an attend call (module docstring) and how."""
    pairs: dict[tuple, list[dict]] = {}
    for r in speed:
        L = r["data"]["launch"]
        pairs.setdefault((L["head_dim"], tuple(L["kv_lens"]), L["heads"], _dtype(r)), []).append(r["data"])
    per, used = [], []
    for launches in pairs.values():
        launches = [d for d in launches if backend in d["attend_ms"] and backend in d["kernel_ms"]]
        if len(launches) < 2:
            continue
        a, b = sorted(launches, key=lambda d: len(d["launch"]["q_lens"]))[:: len(launches) - 1]
        if any(d["attend_ms"][backend] < HOST_BOUND * d["kernel_ms"][backend] for d in (a, b)):
            continue
        dq = len(b["launch"]["q_lens"]) - len(a["launch"]["q_lens"])
        grow = (b["attend_ms"][backend] - a["attend_ms"][backend]) - (b["kernel_ms"][backend] - a["kernel_ms"][backend])
        per.append(grow * 1e-3 / dq)
        used.append(a["launch"]["name"].split(":")[0])
    if not per:
        return 0.0, ("not separable: no model's launches are host-bound (attend per call >= "
                     f"{HOST_BOUND:g}x its kernel); the host per call carries it")
    return statistics.mean(per), (
        f"speed stage: attend per call back to back minus the kernel, between each model's two "
        f"launch shapes, per extra query chunk; mean over {', '.join(used)}")


def replay_profile(costs: dict) -> HardwareProfile:
    """The replay's world: one GPU of the run's kind stands for rank 0; every transfer is a
    device-to-device copy on the communicator's pool streams at the GPU's copy rate (no
    link; its launch folded into ``chunk_s``), barriers find no peer to wait for; compute
    and host as ``costs``."""
    run = costs["run"]
    machine = next((m for m in MACHINES.values() if m.gpu in run["gpu"]), None)
    if machine is None and not costs.get("copy_bw"):
        raise ValueError(f"{run['gpu']}: no datasheet copy rate for this GPU; measure it (copy_bw)")
    prof = measured_gpu_profile(f"replay-{run['commit']}", machine or MACHINES["p5"], costs, scale=1.0)
    copy = Rate(prof.copy_bw, 0.0)
    return replace(prof, transfers={k: {"intra": copy, "inter": copy} for k in KINDS},
                   barrier_s=0.0, sync_s=0.0, inter_gpu_bw=None,
                   figures={**prof.figures, "transfers": f"replay: device copies at {prof.figures['copy_bw']}",
                            "barrier_s": "replay: no peer to wait for"})


def predict_replay(costs: dict, model: ModelShape) -> tuple[float, float]:
    """(GPU seconds with the host ahead, host seconds) of rank 0's layer of ``model`` in the
    replay's world (``replay_profile``), with the run's launches."""
    prof = replay_profile(costs)
    ops = replay_program(model, _launches(costs))
    dtype = "bf16"
    topo = Topology(4, 8)
    ahead = replace(prof, attend_call_s=0.0, merge_call_s=0.0, transfer_call_s=0.0)
    gpu = simulate_alone(ops, 0, topo, ahead, dtype, model.head_dim).finish_s[0]
    host = simulate_alone(ops, 0, topo, prof, dtype, model.head_dim).host_s[0]
    return gpu, host


def _least_squares(cols: list[list[float]], y: list[float], scale: list[float]) -> list[float]:
    """Coefficients (one or two, none below 0) minimizing
    sum_i ((sum_j c_j cols[j][i] - y[i]) / scale[i])^2: least squares of the error relative to
    ``scale`` (the measured figure)."""
    A = [[c[i] / scale[i] for c in cols] for i in range(len(y))]
    b = [y[i] / scale[i] for i in range(len(y))]
    s = lambda j, k: sum(a[j] * a[k] for a in A)  # noqa: E731
    t = lambda j: sum(a[j] * bi for a, bi in zip(A, b))  # noqa: E731
    if len(cols) == 1:
        return [max(0.0, t(0) / s(0, 0))]
    det = s(0, 0) * s(1, 1) - s(0, 1) ** 2
    return [max(0.0, (t(0) * s(1, 1) - t(1) * s(0, 1)) / det), max(0.0, (t(1) * s(0, 0) - t(0) * s(0, 1)) / det)]


def baseline_costs(usp: dict) -> dict:
    """The baseline's compute from its measured rows: per call FLOP/s with its merge at the
    call's (queries, keys per ring step), host per call."""
    table: dict = {}
    for r in usp["rows"]:
        lk = r["keys"] // r["calls"]
        flops = 4.0 * r["heads"] * r["queries"] * lk * r["head_dim"] * r["calls"]
        table.setdefault(r["head_dim"], []).append((r["queries"], lk, flops / (r["gpu_ms"] * 1e-3)))
    return {"attention": table_to_json({"bf16": {D: tuple(sorted(p)) for D, p in table.items()}}),
            "attend_call_s": statistics.mean(r["host_ms"] * 1e-3 / r["calls"] for r in usp["rows"]),
            "transfer_call_s": 0.0, "how": usp["how"]}


def _launches(costs: dict) -> str:
    return costs["run"].get("launches", DEFAULT_LAUNCHES)


def derive(rows: list[dict], run: dict, baseline: dict | None = None, models=MODELS,
           copy: dict | None = None) -> dict:
    """The costs file (``GPU_COSTS_FORMAT``) of a run's ``rows`` (module docstring);
    ``baseline``: USP's measured compute (default: the run's USP row, else ``USP_MEASURED``);
    ``copy``: ``{"copy_bw", "copy_how"}`` where the copy rate was measured (else the GPU's
    datasheet rate serves)."""
    replays = replay_rows(rows, models)
    if not replays:
        raise ValueError("the run has no replay row with host and GPU time")
    baseline = baseline or usp_rows(rows, models) or USP_MEASURED
    modes = {d.get("launch_mode", DEFAULT_LAUNCHES) for d in replays.values()}
    if len(modes) != 1:
        raise ValueError(f"the run's replay rows mix launch modes {sorted(modes)}")
    run = {**run, "launches": modes.pop()}
    backend = next(iter(replays.values()))["backend"]
    speed = speed_rows(rows)
    table = kernel_table(speed, backend)
    merge, merge_how = merge_host_s(speed, backend)
    shapes = [m for m in models if m.name in replays]
    progs = {m.name: replay_program(m, run["launches"]) for m in shapes}
    for m in shapes:
        if attend_calls(progs[m.name]) != replays[m.name]["attend_calls"]:
            raise ValueError(f"{m.name}: rank 0's program ({run['launches']} launches) makes "
                             f"{attend_calls(progs[m.name])} attend calls, the run's layer made "
                             f"{replays[m.name]['attend_calls']}")
    counts = {n: _counts(p) for n, p in progs.items()}  # (attend calls, query chunks, transfers)
    host = [replays[n]["host_ms"] * 1e-3 for n in progs]
    a, t = _least_squares([[counts[n][0] for n in progs], [counts[n][2] for n in progs]],
                          [h - merge * counts[n][1] for h, n in zip(host, progs)], host)
    meshes = [torus_mesh(Topology(4, 8), m.heads) for m in shapes]  # (mesh, heads)
    bh = [H // (mesh.torus * mesh.ulysses_intra) for mesh, H in meshes]  # heads per launch
    fitted = f"the replay ({', '.join(progs)}; {backend})"
    how = {
        "attention": f"{backend}'s kernel per launch shape, speed stage (CUDA graph)",
        "merge_call_s": merge_how,
        "attend_call_s": f"least squares of the host time per layer of {fitted}, with transfer_call_s",
        "transfer_call_s": f"least squares of the host time per layer of {fitted}, with attend_call_s "
                           "(transfers of the replay's communicator: device copies issued as NVSHMEM's)",
        "chunk_s": f"least squares of the GPU time per layer of {fitted} against the timeline without it",
    }
    costs = {
        "format": GPU_COSTS_FORMAT, "run": run,
        "ours": {"backend": backend, "bh": statistics.mode(bh),
                 "attention": table_to_json(table), "attend_call_s": a, "merge_call_s": merge,
                 "transfer_call_s": t, "chunk_s": 0.0, "how": how},
        "baseline": baseline_costs(baseline),
        "replay": {n: {k: replays[n][k] for k in ("backend", "gpu_ms", "host_ms", "graph_ms", "attend_calls", "copies")}
                   for n in progs},
        **(copy or {}),
    }
    gpu = [replays[n]["gpu_ms"] * 1e-3 for n in progs]
    without = [predict_replay(costs, m)[0] for m in shapes]  # the timeline with chunk_s = 0
    (costs["ours"]["chunk_s"],) = _least_squares([[counts[n][1] for n in progs]],
                                                 [g - g0 for g, g0 in zip(gpu, without)], gpu)
    return costs


def check_replay(costs: dict, models=MODELS) -> list[dict]:
    """Per model of the run's replay: measured and predicted GPU and host time per layer (ms),
    their errors, and attend calls of rank 0's program against the run's."""
    out = []
    for m in models:
        row = costs["replay"].get(m.name)
        if row is None:
            continue
        gpu, host = predict_replay(costs, m)
        out.append({"model": m.name, "gpu_ms": row["gpu_ms"], "predicted_gpu_ms": gpu * 1e3,
                    "gpu_err": gpu * 1e3 / row["gpu_ms"] - 1, "host_ms": row["host_ms"],
                    "predicted_host_ms": host * 1e3, "host_err": host * 1e3 / row["host_ms"] - 1,
                    "attend_calls": row["attend_calls"],
                    "program_attend_calls": attend_calls(replay_program(m, _launches(costs)))})
    return out


def format_check(check: list[dict]) -> str:
    lines = ["| model, rank 0 of 4 x 8 | GPU measured | predicted | error | host measured | predicted | error |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for c in check:
        lines.append(f"| {c['model']} | {c['gpu_ms']:.2f} ms | {c['predicted_gpu_ms']:.2f} ms | "
                     f"{100 * c['gpu_err']:+.1f} % | {c['host_ms']:.2f} ms | {c['predicted_host_ms']:.2f} ms | "
                     f"{100 * c['host_err']:+.1f} % |")
    return "\n".join(lines)


# The models of the replay as ``plan`` takes them on 4 x 8 GPUs (B=1, bf16): Flux's text in the
# sequence; CogVideoX 5B's 17550 + 226 tokens rounded up to 32 x 556 (the model has no text apart)
ADVICE = (("Flux 3072 px", 24, 37376, 128), ("Flux 4096 px", 24, 66048, 128),
          ("CogVideoX 5B", 48, 17792, 64))
ADVICE_PROFILES = ("p5", "p4de")


def advice_table(profiles=ADVICE_PROFILES) -> str:
    """What ``plan`` predicts on 4 x 8 GPUs for ``ADVICE``'s models on each of ``profiles``
    (every strategy as ``init_sequence_parallel`` runs it, ``auto``'s pick): a markdown table
    of ms per layer, GPU / host beside."""
    from ..cost_model import Workload, get_profile, predict, recommend
    names = [s.name for s in modelled()]
    topo = Topology(4, 8)
    lines = ["| model, 4 x 8 | profile | " + " | ".join(names) + " | auto picks |",
             "| --- | --- | " + " | ".join("---:" for _ in names) + " | --- |"]
    for model, H, L, D in ADVICE:
        w = Workload(1, L, H, D)
        for hw in profiles:
            prof = get_profile(hw, topo)
            cells = [f"{p.latency_s * 1e3:.2f} ({p.compute_s * 1e3:.2f} / {p.host_s * 1e3:.2f})"
                     for p in (predict(n, topo, w, prof) for n in names)]
            best = recommend(topo, w, prof)
            lines.append(f"| {model} | {hw} | " + " | ".join(cells)
                         + f" | {best.strategy} U{best.ulysses}xR{best.ring} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="a GPU suite run's folder (rows.jsonl, README.md)")
    ap.add_argument("--out", type=Path, default=GPU_COSTS_PATH, help="costs file to write")
    ap.add_argument("--advice", action="store_true",
                    help="also print plan's table for the replay's models on p5 and p4de (as the "
                         "docs show it: after writing the costs file the profiles read)")
    a = ap.parse_args(argv)
    rows = load_rows(a.run)
    costs = derive(rows, run_info(a.run, rows))
    a.out.write_text(json.dumps(costs, indent=1) + "\n")
    print(format_check(check_replay(costs)))
    print(f"wrote {a.out}")
    if a.advice:
        print(advice_table())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
