"""``swiftfusion compare``: one model, the same inputs, every strategy, one launch.

Every rank loads the pipeline; rank 0 first runs it on one device without sequence
parallelism (plain diffusers: the reference), then the transformer is sharded the xFuser way
(``models.parallel``) and each strategy denoises the same prompt from the same seed, the
strategies interleaved over ``repeats`` rounds. Per strategy:

- ``step_latency_s``: median wall time of one denoising step (steps 2..n of every round;
  step 1 also encodes the prompt);
- ``attention_latency_s``: median time of one call of xFuser's ``USP`` (one attention layer);
- ``inter_node_bytes_per_gpu``: inter-machine bytes one GPU sends per denoising step, mean
  over GPUs (``SequenceParallelContext.stats()``; for ``usp``, whose collectives are xFuser's,
  counted by the volume model: see ``modelled_usp_bytes``);
- ``peak_memory_bytes``: the largest per-rank peak (CUDA: ``max_memory_allocated``; CPU:
  peak resident set size sampled every 2 ms while the strategy runs);
- ``max_abs_err``: max |final latents - reference| over rounds; ``passed``: <= tolerance.

Tolerance (whole-model final latents, against the single-device run in the same dtype):
fp32 1e-4, bf16 / fp16 1e-1. Measured on the tiny models, emulated 2x2, 4 steps: fp32
4.8e-7 (Flux) and 6.0e-7..7.2e-7 (CogVideoX) for every strategy (reordered softmax sums), a
>100x margin, while counting replicated text keys once per rank (xFuser's runner bug) moves
them by >1e-2 (tests/test_models.py); bf16 1.6e-2..3.1e-2 (Flux), i.e. one bf16 ulp at
|latent| in [2, 8): the bound allows ~3 ulps there.
"""
from __future__ import annotations

import contextlib
import importlib
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from ..distributed import init_distributed_from_env
from ..emulation.netns import link_from_args
from ..log import get_logger
from ..mesh import counted_inter_node_elements
from ..strategies import get, names
from .measure import PeakMemory
from .quiet import quiet_rank

logger = get_logger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-1, torch.float16: 1e-1}
# defaults per model kind: (height, width, num_frames)
DEFAULT_SIZE = {"flux": (48, 48, 1), "cogvideox": (192, 64, 9), "wan": (64, 64, 9)}
VIDEO_KINDS = ("cogvideox", "wan")   # the kinds whose size names a frame count


@dataclass
class CompareConfig:
    model: str                       # as given (tiny-flux, tiny-cogvideox, tiny-wan, a directory)
    kind: str                        # "flux" | "cogvideox" | "wan"
    path: str                        # checkpoint directory
    strategies: list[str]
    steps: int = 4
    height: int = 48
    width: int = 48
    num_frames: int = 9
    prompt: str = "a photo of a red cat sitting on a street at night"
    max_sequence_length: int = 13    # text tokens (13: not divisible by most SP degrees)
    guidance_scale: float = 1.0
    seed: int = 0
    repeats: int = 2
    dtype: str = "fp32"
    topology: str | None = None
    timeout_s: float | None = None
    reference: bool = True


@dataclass
class CompareRow:
    """One strategy's result; ``--json`` writes the JSON_FIELDS (all but ``ran_as``)."""
    strategy: str
    mesh: str
    step_latency_s: float
    attention_latency_s: float
    inter_node_bytes_per_gpu: float
    peak_memory_bytes: int
    max_abs_err: float | None
    passed: bool | None
    ran_as: str = ""     # differs from strategy for auto (auto:<pick>) or a logged fallback


JSON_FIELDS = tuple(f.name for f in fields(CompareRow) if f.name != "ran_as")


# --------------------------------------------------------------------------------------------
# measurement helpers
# --------------------------------------------------------------------------------------------

def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@dataclass
class AttentionCalls:
    """Per-call durations (s) and image-shard shapes ``(B, H, S_local, D, bytes per element)``."""
    durations: list[float] = field(default_factory=list)
    shapes: list[tuple[int, int, int, int, int]] = field(default_factory=list)


@contextlib.contextmanager
def time_calls(module, name: str, package: str) -> Iterator[AttentionCalls]:
    """Time every call of ``module.<name>`` as currently bound (shapes of its first argument
    plus bytes per element): wraps ``<name>`` in every imported ``<package>.*`` module that
    holds that binding (callers look it up there at call time) and restores it on exit."""
    current = getattr(module, name)
    calls = AttentionCalls()

    def timed(query, *args, **kwargs):
        _sync()
        t0 = time.perf_counter()
        out = current(query, *args, **kwargs)
        _sync()
        calls.durations.append(time.perf_counter() - t0)
        calls.shapes.append((*query.shape, query.element_size()))
        return out

    holders = [m for n, m in list(sys.modules.items())
               if n.startswith(package + ".") and m is not None and getattr(m, name, None) is current]
    for m in holders:
        setattr(m, name, timed)
    try:
        yield calls
    finally:
        for m in holders:
            if getattr(m, name, None) is timed:
                setattr(m, name, current)


def time_attention_calls() -> contextlib.AbstractContextManager[AttentionCalls]:
    """Time every call of xFuser's ``USP`` (as currently bound, e.g. to our strategy);
    shapes ``[B, H, S_local, D]``."""
    from xfuser.model_executor.layers import usp as usp_module
    return time_calls(usp_module, "USP", "xfuser")


def modelled_usp_bytes(mesh, shapes: list[tuple[int, ...]], rank: int) -> int:
    """Inter-machine bytes ``rank`` sends in xFuser's USP for the recorded calls.

    xFuser's USP runs on torch/yunchang collectives that our byte counters do not see, so
    its traffic is counted with ``topology.counted_inter_node_elements`` (the four Ulysses
    all-to-alls plus a K/V ring; replicated text is head-sliced locally and moves nothing).
    Exact for ring degree 1; for ring > 1 it counts a true ring, while torch's default
    rotation all-gathers K/V (more bytes).
    """
    total = 0
    for B, H, S, D, size in shapes:
        total += counted_inter_node_elements(mesh, B, S * mesh.world_size, H, D)[rank] * size
    return total


def _effective(ctx) -> tuple[str, object]:
    """(strategy that ran, its mesh): a strategy that picks per shape (``auto``) reports its
    one pick (e.g. ``auto:swiftfusion``)."""
    choices = set(getattr(ctx._impl, "choices", {}).values())
    if len(choices) != 1:
        return ctx.strategy, ctx.mesh
    strategy, ulysses = choices.pop()
    mesh = next(m for (s, u, _), m in ctx._impl.meshes.items() if (s, u) == (strategy, ulysses))
    return f"{ctx.strategy}:{strategy}", mesh


def _mesh_label(mesh) -> str:
    """``UxRxT``: intra-machine Ulysses x Ring x Torus (machines per Ulysses group)."""
    return f"{mesh.ulysses_intra}x{mesh.ring}x{mesh.torus}"


# --------------------------------------------------------------------------------------------
# the collective run (every rank)
# --------------------------------------------------------------------------------------------

@dataclass
class _Measure:
    """One rank's measurements of one strategy, accumulated over rounds."""
    ran_as: str = ""
    mesh: str = ""
    steps: list[float] = field(default_factory=list)
    attention: list[float] = field(default_factory=list)
    inter_bytes_per_step: list[float] = field(default_factory=list)
    peak: int = 0
    err: float | None = None

    def add_round(self, stamps: list[float], attention: list[float], sent_bytes: float,
                  steps: int, latents: torch.Tensor, reference: torch.Tensor | None) -> None:
        """One round: step times from the per-step stamps, attention call times, bytes per
        step, and the error of the final latents against the reference (max over rounds)."""
        self.steps += [b - a for a, b in zip(stamps, stamps[1:])]
        self.attention += attention
        self.inter_bytes_per_step.append(sent_bytes / steps)
        if reference is not None:
            err = (latents.double() - reference).abs().max().item()
            self.err = err if self.err is None else max(self.err, err)


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def load_with_reference(cfg: CompareConfig) -> tuple[object, int, dict, torch.Tensor | None]:
    """Collective: every rank loads the pipeline; rank 0 runs it on one device (the reference
    latents, fp64). Returns (pipe, heads, generation kwargs, reference or None)."""
    from .models.parallel import generate_latents, load_pipeline
    pipe = load_pipeline(cfg.path, cfg.kind, DTYPES[cfg.dtype], _device())
    gen_kwargs = dict(prompt=cfg.prompt, height=cfg.height, width=cfg.width,
                      num_frames=cfg.num_frames, steps=cfg.steps, seed=cfg.seed,
                      guidance_scale=cfg.guidance_scale,
                      max_sequence_length=cfg.max_sequence_length)
    reference = None
    if cfg.reference and dist.get_rank() == 0:
        reference = generate_latents(pipe, cfg.kind, **gen_kwargs).double()
    dist.barrier()
    return pipe, pipe.transformer.config.num_attention_heads, gen_kwargs, reference


def run_compare(cfg: CompareConfig) -> list[CompareRow]:
    """Collective over the default process group; every rank returns the same rows."""
    from .models.parallel import PARALLELIZE, generate_latents, strategy_session
    rank = dist.get_rank()
    dtype = DTYPES[cfg.dtype]
    pipe, heads, gen_kwargs, reference = load_with_reference(cfg)
    PARALLELIZE[cfg.kind](pipe)
    measures = {s: _Measure() for s in cfg.strategies}
    rounds = [(r, s) for r in range(cfg.repeats) for s in cfg.strategies]
    progress = None
    if rank == 0:
        from tqdm import tqdm
        progress = tqdm(total=len(rounds) * cfg.steps, desc="compare", unit="step",
                        disable=not sys.stderr.isatty())
    for _, strategy in rounds:
        m = measures[strategy]
        with strategy_session(strategy, heads, cfg.topology, timeout_s=cfg.timeout_s) as ctx:
            ctx.reset_stats()
            stamps: list[float] = []

            def on_step(_i: int) -> None:
                _sync()
                stamps.append(time.perf_counter())
                if progress is not None:
                    progress.update(1)

            mem = PeakMemory().start()
            # no torch.inference_mode: the one-sided copy threads write into these tensors
            with time_attention_calls() as attn:
                latents = generate_latents(pipe, cfg.kind, on_step=on_step, **gen_kwargs)
            m.peak = max(m.peak, mem.stop())
            m.ran_as, mesh = _effective(ctx)
            m.mesh = _mesh_label(mesh)
            ran = get(m.ran_as.split(":")[-1])
            # xFuser's own collectives bypass our byte counters: count them with the model
            sent = (modelled_usp_bytes(mesh, attn.shapes, rank) if ran.external_groups
                    else ctx.stats()["inter_node_bytes"])
        m.add_round(stamps, attn.durations, sent, cfg.steps, latents, reference)
    if progress is not None:
        progress.close()
    return _aggregate(measures, dtype)


def _aggregate(measures: dict[str, _Measure], dtype: torch.dtype) -> list[CompareRow]:
    """Gather every rank's measures; combine (medians, mean bytes, max memory, rank 0 error)."""
    world = dist.get_world_size()
    gathered: list[dict] = [None] * world  # type: ignore[list-item]
    dist.all_gather_object(gathered, {s: asdict(m) for s, m in measures.items()})
    rows = []
    tol = TOLERANCE[dtype]
    for s in measures:
        per_rank = [g[s] for g in gathered]
        err = per_rank[0]["err"]
        rows.append(CompareRow(
            strategy=s, mesh=per_rank[0]["mesh"],
            step_latency_s=statistics.median(x for r in per_rank for x in r["steps"]),
            attention_latency_s=statistics.median(x for r in per_rank for x in r["attention"]),
            inter_node_bytes_per_gpu=statistics.fmean(
                statistics.median(r["inter_bytes_per_step"]) for r in per_rank),
            peak_memory_bytes=max(r["peak"] for r in per_rank),
            max_abs_err=err, passed=None if err is None else bool(err <= tol),
            ran_as=per_rank[0]["ran_as"]))
        if per_rank[0]["ran_as"] != s and dist.get_rank() == 0:
            logger.info(f"compare: {s} ran as {per_rank[0]['ran_as']} ({per_rank[0]['mesh']})")
    return rows


# --------------------------------------------------------------------------------------------
# output
# --------------------------------------------------------------------------------------------

def format_table(rows: list[CompareRow], cfg: CompareConfig, where: str) -> str:
    tol = TOLERANCE[DTYPES[cfg.dtype]]
    size = f"{cfg.height}x{cfg.width}" + (f"x{cfg.num_frames}f" if cfg.kind in VIDEO_KINDS else "")
    lines = [f"compare: {cfg.model} ({cfg.kind}) {size}, {cfg.steps} steps, text "
             f"{cfg.max_sequence_length} tokens, {cfg.dtype}, {where}, {cfg.repeats} rounds "
             f"interleaved; tolerance {tol:.0e} vs single device"]
    head = (f"{'strategy':<17} {'mesh UxRxT':<10} {'step ms':>9} {'attn ms/layer':>13} "
            f"{'inter-node KB/GPU/step':>22} {'peak MB/rank':>12} {'max abs err':>11}  result")
    lines += [head, "-" * len(head)]
    for r in rows:
        err = "n/a" if r.max_abs_err is None else f"{r.max_abs_err:.2e}"
        res = "n/a" if r.passed is None else ("PASS" if r.passed else "FAIL")
        name = r.strategy if r.ran_as in ("", r.strategy) else f"{r.strategy}>{r.ran_as.split(':')[-1]}"
        lines.append(f"{name:<17} {r.mesh:<10} {r.step_latency_s * 1e3:>9.1f} "
                     f"{r.attention_latency_s * 1e3:>13.2f} "
                     f"{r.inter_node_bytes_per_gpu / 1e3:>22.1f} "
                     f"{r.peak_memory_bytes / 2**20:>12.0f} {err:>11}  {res}")
    return "\n".join(lines)


def write_plot(rows: list[CompareRow], path: str, title: str) -> None:
    """PNG bar chart: median step latency and inter-machine bytes per GPU per step."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = [r.strategy for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.6))
    a.bar(names, [r.step_latency_s * 1e3 for r in rows], color="tab:blue")
    a.set_ylabel("median step latency (ms)")
    b.bar(names, [r.inter_node_bytes_per_gpu / 1e3 for r in rows], color="tab:orange")
    b.set_ylabel("inter-machine KB per GPU per step")
    for ax in (a, b):
        ax.tick_params(axis="x", rotation=20)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------------------------
# command line (``swiftfusion compare``)
# --------------------------------------------------------------------------------------------

def add_arguments(p) -> None:
    """Flags of ``swiftfusion compare`` besides the cluster flags cli.py shares with ``check``
    (``--emulate``, ``--link-mbit``, ``--topology``, ``--strategies``, ``--seed``)."""
    p.add_argument("--model", default="tiny-flux",
                   help="tiny-flux, tiny-cogvideox, tiny-wan or a local FLUX.1 / CogVideoX / Wan "
                        "checkpoint dir")
    p.add_argument("--steps", type=int, default=4, help="denoising steps per run (>= 2)")
    p.add_argument("--height", type=int, help="pixels (default: flux 48, cogvideox 192, wan 64)")
    p.add_argument("--width", type=int, help="pixels (default: flux 48, cogvideox 64, wan 64)")
    p.add_argument("--num-frames", type=int, help="video frames (cogvideox, wan; default 9)")
    p.add_argument("--max-sequence-length", type=int, default=None,
                   help="text tokens (default 13; --engine sglang: 64)")
    p.add_argument("--prompt", default=CompareConfig.prompt)
    p.add_argument("--guidance-scale", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=2, help="interleaved rounds per strategy")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--no-reference", action="store_true",
                   help="skip the single-device run (no error column)")
    p.add_argument("--timeout", type=float, default=None, help="per-wait timeout in seconds")
    p.add_argument("--json", metavar="FILE", help="write one object per strategy")
    p.add_argument("--plot", metavar="FILE", help="write a PNG bar chart (latency, bytes)")


class CompareArgumentError(ValueError):
    """An inconsistent ``swiftfusion compare`` invocation (printed as ``error: ...``)."""


def config_from_args(args, world_size: int) -> CompareConfig:
    """Validate flags against the model and the world size before any rank starts."""
    from .models.parallel import check_shapes, resolve_model
    strategies = ([s.strip() for s in args.strategies.split(",") if s.strip()]
                  if args.strategies else list(names()))
    bad = [s for s in strategies if s not in names()]
    if bad or not strategies:
        raise CompareArgumentError(f"unknown strategy {', '.join(bad) or '(none given)'}; "
                                   f"choose from {', '.join(names())}")
    if args.steps < 2:
        raise CompareArgumentError("--steps must be >= 2 (step 1 also encodes the prompt and "
                                   "is not timed)")
    kind, path = resolve_model(args.model)
    h, w, f = DEFAULT_SIZE[kind]
    dtype = args.dtype or ("bf16" if torch.cuda.is_available() else "fp32")
    cfg = CompareConfig(model=args.model, kind=kind, path=path, strategies=strategies,
                        steps=args.steps, height=args.height or h, width=args.width or w,
                        num_frames=args.num_frames or f, prompt=args.prompt,
                        max_sequence_length=args.max_sequence_length
                        or CompareConfig.max_sequence_length,
                        guidance_scale=args.guidance_scale, seed=args.seed,
                        repeats=args.repeats, dtype=dtype, topology=args.topology,
                        timeout_s=args.timeout, reference=not args.no_reference)
    check_shapes(kind, path, cfg.height, cfg.width, world_size, cfg.num_frames)
    return cfg


def _compare_rank(cfg: CompareConfig) -> list[dict]:
    quiet_rank(dist.get_rank())  # the table is the output
    return [asdict(r) for r in run_compare(cfg)]


def run_on_ranks(args, make_config: Callable, rank_fn: Callable, preload: tuple[str, ...] = ()
                 ) -> tuple[list[dict], object, str | None]:
    """``rank_fn(cfg)`` on every rank: forked emulated ranks (``--emulate NxM``, optionally
    over throttled links) or this torchrun rank; ``make_config(topology)`` validates the flags
    first. Returns (rows, cfg, where the run was); ``where`` is None on torchrun ranks but 0."""
    from ..emulation.launcher import run_emulated
    from ..topology import Topology, detect_topology
    if args.emulate:
        topo = Topology.parse(args.emulate)
        cfg = make_config(topo)
        for module in ("diffusers", *preload):  # once in the parent: forked ranks inherit them
            importlib.import_module(module)
        link = link_from_args(args)
        rows = run_emulated(rank_fn, topo, cfg, timeout_s=300.0 + 60.0 * cfg.repeats *
                            len(cfg.strategies), link=link)[0]
        return rows, cfg, f"emulated {topo} ({topo.world_size} ranks" + (
            f", {link.rate_mbit:g} Mbit/s links)" if link else ")")
    try:
        init_distributed_from_env()
    except RuntimeError as exc:
        raise CompareArgumentError(str(exc)) from None
    cfg = make_config(detect_topology(dist.get_world_size(), args.topology))
    rows = rank_fn(cfg)
    return rows, cfg, f"{dist.get_world_size()} ranks" if dist.get_rank() == 0 else None


def cmd_compare(args) -> int:
    """``swiftfusion compare``: returns the exit code (0: every strategy passed)."""
    import json
    rows, cfg, where = run_on_ranks(args, lambda topo: config_from_args(args, topo.world_size),
                                    _compare_rank, preload=("xfuser.model_executor.layers.usp",))
    if where is None:  # not the reporting rank
        return 0 if all(r["passed"] is not False for r in rows) else 1
    table_rows = [CompareRow(**r) for r in rows]
    print(format_table(table_rows, cfg, where))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{k: r[k] for k in JSON_FIELDS} for r in rows], f, indent=2)
    if args.plot:
        write_plot(table_rows, args.plot, f"{cfg.model}, {where}")
    return 0 if all(r.passed is not False for r in table_rows) else 1


__all__ = ["CompareConfig", "CompareRow", "JSON_FIELDS", "TOLERANCE", "add_arguments", "cmd_compare",
           "config_from_args", "format_table", "modelled_usp_bytes", "run_compare",
           "time_attention_calls", "write_plot"]
