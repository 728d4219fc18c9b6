"""``swiftfusion compare --engine sglang``: SGLang's own USP at its Ulysses x Ring splits and our
strategies on SGLang's own Flux model class, side by side, one launch.

Every rank builds SGLang's ``FluxTransformer2DModel`` (``tiny-flux``: a tiny random config,
``HEADS`` heads x ``HEAD_DIM``, one double and one single block, the same seeded weights on
every rank) and SGLang's distributed state (``sglang_runtime``). Inputs: ``(H / 16) x (W / 16)``
image tokens sharded in SP-rank order, ``--max-sequence-length`` random text embeddings that
SGLang shards with the image (a length that is not a multiple of the ranks is tail-padded and
passed as attention mask metadata, which our strategies leave to SGLang's path: counted as
fallbacks). Rows, interleaved over ``repeats`` rounds of ``steps`` forwards (the first of each
round untimed: it makes the contexts and plans):

- ``sglang:UuxRr``: SGLang's ``USPAttention`` at Ulysses ``u`` x Ring ``r`` (``u * r`` = ranks,
  ``heads % u == 0``; Ulysses groups contiguous ranks, ring groups strided). A split whose
  layer SGLang refuses to build (its Ring needs a backend exposing the softmax LSE, which torch
  SDPA, its CPU backend, does not) is skipped and named once under the table;
- ``tas`` / ``torus`` / ``swiftfusion`` / ``auto``: ``USPAttention.forward`` hooked onto the
  strategy (``integrations.sglang.install``) over SGLang's SP group.

Per row: median forward latency (between barriers), median ``USPAttention.forward`` call,
inter-machine bytes per GPU per forward (ours: ``ctx.stats()``; SGLang's: the volume model of
Ulysses all-to-alls and a K/V ring, ``compare_diffusers.modelled_diffusers_bytes``; replicated
text moves nothing), peak memory (``measure.PeakMemory``), the largest difference of the rank's
output to the forward on one rank (SGLang's SP degree 1 through a CFG-parallel group of every
rank: no exchange, the same model and inputs), our strategies' fallbacks, and the limit
``max(compute only, link time)``: compute only is the same forward with each attention call on
local data (the rank's queries against its own K/V repeated to the full length: the attention
FLOPs of a rank, no exchange); link time is a machine's inter-machine bytes per forward at the
link's line rate (``--link-mbit``).
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import time
from dataclasses import asdict, dataclass, field
from typing import Iterator

import torch
import torch.distributed as dist

from ..strategies import get
from ..topology import Topology, detect_topology
from .compare import (DTYPES, JSON_FIELDS, AttentionCalls, CompareArgumentError, CompareConfig,
                      CompareRow, TOLERANCE, _aggregate, _device, _effective, _Measure,
                      _mesh_label, _sync, modelled_usp_bytes, run_on_ranks)
from .compare_diffusers import diffusers_mesh_label, modelled_diffusers_bytes
from .measure import PeakMemory
from .quiet import quiet_rank

MODEL = "tiny-flux"
HEADS, HEAD_DIM = 8, 64
DEFAULT_SIZE = (512, 512)   # 32 x 32 = 1024 image tokens
TEXT_TOKENS = 64            # a multiple of the ranks: SGLang shards it without padding
OURS = ("tas", "torus", "swiftfusion", "auto")
PREFIX = "sglang"
COMPUTE = "compute only"
RING_REFUSED = "Ring Attention requires"  # SGLang's error where its backend has no LSE
ATTENTION = "sglang.multimodal_gen.runtime.layers.attention.layer"


@dataclass
class SglangCompareConfig(CompareConfig):
    link_mbit: float | None = None
    splits: list[tuple[int, int]] = field(default_factory=list)  # SGLang's (ulysses, ring) rows


def split_name(ulysses: int, ring: int) -> str:
    return f"{PREFIX}:U{ulysses}xR{ring}"


def parse_split(name: str) -> tuple[int, int] | None:
    """``sglang:U2xR2`` -> ``(2, 2)``; None for any other name."""
    if not name.startswith(PREFIX + ":U"):
        return None
    u, _, r = name.removeprefix(PREFIX + ":U").partition("xR")
    return (int(u), int(r)) if u.isdigit() and r.isdigit() else None


def sglang_splits(world: int, heads: int = HEADS) -> list[tuple[int, int]]:
    """SGLang's valid ``(ulysses, ring)`` splits of ``world`` SP ranks, most Ulysses first."""
    return [(u, world // u) for u in range(world, 0, -1) if world % u == 0 and heads % u == 0]


def import_sglang() -> None:
    """Import SGLang's attention layer, or raise ``CompareArgumentError`` naming why."""
    import warnings
    try:
        with warnings.catch_warnings():  # its quantization modules warn that CPUs lack them
            warnings.simplefilter("ignore")
            importlib.import_module(ATTENTION)
    except ImportError as exc:
        raise CompareArgumentError(
            f"--engine sglang: SGLang's diffusion runtime does not import here ({exc}); "
            "install it with pip install 'xfuser-swiftfusion[sglang]'") from None


# --------------------------------------------------------------------------------------------
# the model and its inputs (every rank)
# --------------------------------------------------------------------------------------------

def build_model(dtype: torch.dtype) -> torch.nn.Module:
    """SGLang's ``FluxTransformer2DModel`` with the tiny config, seeded weights (0.05 N(0, 1)),
    on this rank's device."""
    from sglang.multimodal_gen.configs.models.dits.flux import FluxArchConfig, FluxConfig
    from sglang.multimodal_gen.runtime.models.dits.flux import FluxTransformer2DModel
    arch = FluxArchConfig(num_layers=1, num_single_layers=1, attention_head_dim=HEAD_DIM,
                          num_attention_heads=HEADS, in_channels=16, joint_attention_dim=32,
                          pooled_projection_dim=16, axes_dims_rope=(16, 24, 24))
    model = FluxTransformer2DModel(FluxConfig(arch_config=arch), hf_config={})
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model.to(_device(), dtype).eval()


@dataclass
class Inputs:
    """Global inputs (the same on every rank): image latents ``[1, L, 16]``, text ``[1, T, 32]``,
    pooled text ``[1, 16]``, position ids ``[T + L, 3]`` (text 0, image (0, row, column))."""
    x: torch.Tensor
    text: torch.Tensor
    pooled: torch.Tensor
    ids: torch.Tensor

    @classmethod
    def make(cls, cfg: CompareConfig, dtype: torch.dtype) -> "Inputs":
        g = torch.Generator().manual_seed(cfg.seed + 1)
        rows, cols = cfg.height // 16, cfg.width // 16
        T = cfg.max_sequence_length
        grid = torch.stack(torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij"), -1)
        image_ids = torch.cat([torch.zeros(rows * cols, 1), grid.reshape(-1, 2).float()], 1)
        device = _device()
        return cls(torch.randn(1, rows * cols, 16, generator=g).to(device, dtype),
                   torch.randn(1, T, 32, generator=g).to(device, dtype),
                   torch.randn(1, 16, generator=g).to(device, dtype),
                   torch.cat([torch.zeros(T, 3), image_ids]).to(device))

    def forward_fn(self, model: torch.nn.Module, rank: int, world: int):
        """The rank's forward: its image shard, the whole text (SGLang shards it), RoPE for the
        text and the rank's image rows."""
        T, L = self.text.shape[1], self.x.shape[1]
        S = L // world
        cos, sin = model.rotary_emb.forward(self.ids)
        img = slice(T + rank * S, T + (rank + 1) * S)
        freqs = (torch.cat([cos[:T], cos[img]]), torch.cat([sin[:T], sin[img]]))
        x = self.x[:, rank * S:(rank + 1) * S]
        t, gd = (torch.tensor([v], dtype=x.dtype, device=x.device) for v in (500.0, 3.5))
        return lambda: model(x, self.text, self.pooled, t, gd, freqs_cis=freqs)


# --------------------------------------------------------------------------------------------
# what each row measures on a rank
# --------------------------------------------------------------------------------------------

def _attention_class():
    return importlib.import_module(ATTENTION).USPAttention


@contextlib.contextmanager
def time_uspattention() -> Iterator[AttentionCalls]:
    """Time every ``USPAttention.forward`` call (as currently bound, our hook included) and
    record its sharded rows ``(B, S_local - replicated, H, D, bytes per element)``."""
    cls = _attention_class()
    current = cls.__dict__["forward"]
    calls = AttentionCalls()

    @functools.wraps(current)  # the hook reads SGLang's signature through __wrapped__
    def timed(self, q, k, v, *args, **kwargs):
        replicated = kwargs.get("num_replicated_prefix", 0) + kwargs.get("num_replicated_suffix", 0)
        _sync()
        t0 = time.perf_counter()
        out = current(self, q, k, v, *args, **kwargs)
        _sync()
        calls.durations.append(time.perf_counter() - t0)
        B, S, H, D = q.shape
        calls.shapes.append((B, S - replicated, H, D, q.element_size()))
        return out

    cls.forward = timed
    try:
        yield calls
    finally:
        cls.forward = current


@contextlib.contextmanager
def local_attention() -> Iterator[None]:
    """``USPAttention.forward`` on local data (compute only): the rank's queries ``[B, S_local,
    H, D]`` against its sharded K/V rows repeated to the SP group's length (replicated text
    rows once), torch SDPA; the attention FLOPs of one rank, no exchange."""
    from sglang.multimodal_gen.runtime.distributed.parallel_state import (
        get_sequence_parallel_world_size)
    cls = _attention_class()
    current = cls.__dict__["forward"]

    @functools.wraps(current)
    def local(self, q, k, v, *args, num_replicated_prefix: int = 0,
              num_replicated_suffix: int = 0, **kwargs):
        world = get_sequence_parallel_world_size()
        p, s, n = num_replicated_prefix, num_replicated_suffix, k.shape[1]

        def full(t):
            return torch.cat([t[:, :p], t[:, p:n - s].repeat(1, world, 1, 1), t[:, n - s:]], 1)

        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), full(k).transpose(1, 2), full(v).transpose(1, 2),
            scale=self.softmax_scale, enable_gqa=k.shape[2] != q.shape[2])
        return out.transpose(1, 2)

    cls.forward = local
    try:
        yield
    finally:
        cls.forward = current


def _timed_forwards(forward, steps: int, before_timing=lambda: None
                    ) -> tuple[list[float], torch.Tensor]:
    """``steps`` forwards, the first untimed; returns (stamps between barriers, last output)."""
    out = forward()
    before_timing()
    dist.barrier()
    stamps = [time.perf_counter()]
    for _ in range(steps - 1):
        out = forward()
        _sync()
        dist.barrier()
        stamps.append(time.perf_counter())
    return stamps, out


def _reference(cfg: SglangCompareConfig, inputs: Inputs, dtype: torch.dtype) -> torch.Tensor | None:
    """Rank 0's one-rank forward (fp64) of the whole input: SGLang's SP degree 1, every rank a
    CFG-parallel replica, so nothing is exchanged. Collective; None on other ranks."""
    from . import sglang_runtime
    world = dist.get_world_size()
    sglang_runtime.setup(ulysses=1, ring=1, cfg=world)
    out = None
    if dist.get_rank() == 0:
        out = inputs.forward_fn(build_model(dtype), 0, 1)().double()
    dist.barrier()
    return out


def run_compare_sglang(cfg: SglangCompareConfig) -> dict:
    """Collective over the default process group; every rank returns the same result:
    ``rows`` (``CompareRow`` dicts with ``fallbacks``), ``skipped`` (split name -> reason) and
    ``compute_s`` (median compute-only forward)."""
    from ..integrations import sglang as sfs
    from ..integrations.sglang import hooks
    from . import sglang_runtime
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = DTYPES[cfg.dtype]
    topo = detect_topology(world, cfg.topology)
    inputs = Inputs.make(cfg, dtype)
    with sglang_runtime.forward_context(), torch.no_grad():
        reference = _reference(cfg, inputs, dtype) if cfg.reference else None
        if reference is not None:
            S = inputs.x.shape[1] // world
            reference = reference[:, rank * S:(rank + 1) * S]
        models, skipped = {}, {}
        for split in cfg.splits or sglang_splits(world)[:1]:  # ours run under the first
            sglang_runtime.setup(*split)
            try:
                models[split] = build_model(dtype)
            except RuntimeError as exc:
                if RING_REFUSED not in str(exc):
                    raise
                skipped[split_name(*split)] = str(exc).split(" (see ")[0]
        if not models:
            raise RuntimeError("no SGLang split builds here for our strategies to run under: "
                               + "; ".join(skipped.values()))
        ours_split = next(iter(models))
        current = [split]  # the state the last setup built
        names = [s for s in cfg.strategies if s not in skipped] + [COMPUTE]
        measures = {s: _Measure() for s in names}
        fallbacks: dict[str, dict[str, int]] = {s: {} for s in names if s in OURS}

        def switch(split: tuple[int, int]) -> torch.nn.Module:
            if current[0] != split:
                sglang_runtime.setup(*split)
                current[0] = split
            return models[split]

        for _ in range(cfg.repeats):
            for name in names:
                m = measures[name]
                split = parse_split(name)
                model = switch(split or ours_split)
                forward = inputs.forward_fn(model, rank, world)
                mem = PeakMemory().start()
                if name == COMPUTE:
                    with local_attention(), time_uspattention() as attn:
                        stamps, out = _timed_forwards(forward, cfg.steps, attn.durations.clear)
                    m.peak = max(m.peak, mem.stop())
                    m.ran_as, m.mesh = COMPUTE, "-"
                    m.add_round(stamps, attn.durations, 0, cfg.steps - 1, out, None)
                    continue
                if split is not None:
                    with time_uspattention() as attn:
                        stamps, out = _timed_forwards(
                            forward, cfg.steps, lambda: (attn.durations.clear(), attn.shapes.clear()))
                    m.peak = max(m.peak, mem.stop())
                    m.ran_as, m.mesh = name, diffusers_mesh_label(topo, split[1], split[0])
                    sent = modelled_diffusers_bytes(topo, split[1], split[0], attn.shapes, rank)
                    m.add_round(stamps, attn.durations, sent, cfg.steps - 1, out, reference)
                    continue
                sfs.install(name)
                unbound = sum(hooks.unbound_fallbacks.values())
                try:
                    def reset() -> None:
                        attn.durations.clear()
                        for ctx in sfs.active().values():
                            ctx.reset_stats()

                    with time_uspattention() as attn:
                        stamps, out = _timed_forwards(forward, cfg.steps, reset)
                    m.peak = max(m.peak, mem.stop())
                    ctxs = list(sfs.active().values())
                    sent = sum(c.stats()["inter_node_bytes"] for c in ctxs)
                    if ctxs:
                        m.ran_as, mesh = _effective(ctxs[0])
                        m.mesh = _mesh_label(mesh)
                        if get(m.ran_as.split(":")[-1]).external_groups:  # counters miss them
                            sent = modelled_usp_bytes(mesh, [(B, H, S, D, e) for B, S, H, D, e
                                                             in attn.shapes], rank)
                    else:
                        m.ran_as, m.mesh = f"{name}>sglang", "-"
                    for c in ctxs:
                        for reason, n in c.stats()["fallbacks"].items():
                            fallbacks[name][reason] = fallbacks[name].get(reason, 0) + n
                    extra = sum(hooks.unbound_fallbacks.values()) - unbound
                    if extra:
                        fallbacks[name]["SP groups our strategies cannot run on"] = extra
                finally:
                    sfs.uninstall()
                m.add_round(stamps, attn.durations, sent, cfg.steps - 1, out, reference)
        sglang_runtime.teardown()
    rows = _aggregate(measures, dtype)
    every: list = [None] * world
    dist.all_gather_object(every, fallbacks)
    merged: dict[str, dict[str, int]] = {}
    for per_rank in every:
        for name, reasons in per_rank.items():
            for reason, n in reasons.items():
                merged.setdefault(name, {})[reason] = max(merged.get(name, {}).get(reason, 0), n)
    compute = next(r for r in rows if r.strategy == COMPUTE)
    return {"rows": [{**asdict(r), "fallbacks": merged.get(r.strategy, {} if r.strategy in OURS
                                                              else None)}
                     for r in rows if r.strategy != COMPUTE],
            "skipped": skipped, "compute_s": compute.step_latency_s,
            "compute_peak_bytes": compute.peak_memory_bytes}


def _rank(cfg: SglangCompareConfig) -> dict:
    quiet_rank(dist.get_rank())  # the table is the output
    return run_compare_sglang(cfg)


# --------------------------------------------------------------------------------------------
# flags, table
# --------------------------------------------------------------------------------------------

def select(requested: str | None, world: int) -> tuple[list[str], list[tuple[int, int]]]:
    """(rows, SGLang's splits among them). ``requested``: comma-separated ``sglang`` (every
    valid split), ``sglang:U2xR2`` and our strategies; default: every split and ours."""
    valid = sglang_splits(world)
    wanted = ([s.strip() for s in requested.split(",") if s.strip()] if requested
              else [PREFIX, *OURS])
    rows: list[str] = []
    for s in wanted:
        if s == PREFIX:
            rows += [split_name(*sp) for sp in valid]
        elif s in OURS or parse_split(s) in valid:
            rows.append(s)
        else:
            choices = ", ".join([PREFIX, *(split_name(*sp) for sp in valid), *OURS])
            raise CompareArgumentError(f"unknown or invalid row {s!r} for {world} ranks and "
                                       f"{HEADS} heads (Ulysses x Ring = ranks, heads % Ulysses "
                                       f"== 0); choose from {choices}")
    rows = list(dict.fromkeys(rows))
    return rows, [parse_split(s) for s in rows if parse_split(s)]


def config_from_args_sglang(args, topo: Topology) -> SglangCompareConfig:
    """Validate the flags for ``--engine sglang`` before any rank starts."""
    import_sglang()
    if args.model != MODEL:
        raise CompareArgumentError(f"--engine sglang runs {MODEL} (SGLang's FluxTransformer2DModel, "
                                   f"a tiny random config), not {args.model}")
    if args.steps < 2:
        raise CompareArgumentError("--steps must be >= 2 (the first forward of each round makes "
                                   "the contexts and is not timed)")
    height, width = args.height or DEFAULT_SIZE[0], args.width or DEFAULT_SIZE[1]
    if height % 16 or width % 16:
        raise CompareArgumentError(f"--height {height} --width {width}: must be multiples of 16 "
                                   "(8x VAE, 2x2 patches: one image token per 16 x 16 pixels)")
    tokens, world = (height // 16) * (width // 16), topo.world_size
    if tokens % world:
        raise CompareArgumentError(f"{tokens} image tokens, not divisible by the {world} ranks "
                                   "(SGLang's Flux takes equal image shards)")
    rows, splits = select(args.strategies, world)
    dtype = args.dtype or ("bf16" if torch.cuda.is_available() else "fp32")
    return SglangCompareConfig(
        model=MODEL, kind="flux", path="", strategies=rows, steps=args.steps, height=height,
        width=width, num_frames=1, prompt="(random text embeddings)",
        max_sequence_length=args.max_sequence_length or TEXT_TOKENS, seed=args.seed,
        repeats=args.repeats, dtype=dtype, topology=args.topology, timeout_s=args.timeout,
        reference=not args.no_reference, link_mbit=getattr(args, "link_mbit", None),
        splits=splits)


def link_seconds(row: dict, topo: Topology, link_mbit: float | None) -> float | None:
    """A machine's inter-machine bytes per forward at the line rate (the rows' bytes per GPU
    times the GPUs of a machine), or None without a link rate."""
    if not link_mbit:
        return None
    return row["inter_node_bytes_per_gpu"] * topo.gpus_per_node / (link_mbit * 1e6 / 8)


def format_table(result: dict, cfg: SglangCompareConfig, topo: Topology, where: str) -> str:
    tol = TOLERANCE[DTYPES[cfg.dtype]]
    tokens = (cfg.height // 16) * (cfg.width // 16)
    compute = result["compute_s"]
    lines = [f"compare --engine sglang: {cfg.model} (SGLang's FluxTransformer2DModel, {HEADS} heads "
             f"x {HEAD_DIM}, 1 double + 1 single block) {cfg.height}x{cfg.width}: {tokens} image + "
             f"{cfg.max_sequence_length} text tokens, {cfg.dtype}, {where}; {cfg.repeats} interleaved "
             f"round(s) of {cfg.steps - 1} timed forward(s); tolerance {tol:.0e} vs one rank"]
    head = (f"{'strategy':<15} {'mesh UxRxT':<10} {'fwd ms':>8} {'attn ms/call':>12} "
            f"{'inter-node KB/GPU/fwd':>21} {'link ms':>8} {'limit ms':>8} {'fwd/limit':>9} "
            f"{'peak MB/rank':>12} {'max abs err':>11} {'fallbacks':>9}  result")
    lines += [head, "-" * len(head)]
    for r in result["rows"]:
        err = "n/a" if r["max_abs_err"] is None else f"{r['max_abs_err']:.2e}"
        res = "n/a" if r["passed"] is None else ("PASS" if r["passed"] else "FAIL")
        name = r["strategy"]
        if r["ran_as"] not in ("", name):
            name = f"{name}>{r['ran_as'].split(':')[-1]}"
        link = link_seconds(r, topo, cfg.link_mbit)
        limit = max(compute, link) if link is not None else None
        fb = "-" if r["fallbacks"] is None else str(sum(r["fallbacks"].values()))
        lines.append(
            f"{name:<15} {r['mesh']:<10} {r['step_latency_s'] * 1e3:>8.1f} "
            f"{r['attention_latency_s'] * 1e3:>12.2f} {r['inter_node_bytes_per_gpu'] / 1e3:>21.1f} "
            + (f"{link * 1e3:>8.1f} {limit * 1e3:>8.1f} {r['step_latency_s'] / limit:>9.2f} "
               if limit else f"{'-':>8} {'-':>8} {'-':>9} ")
            + f"{r['peak_memory_bytes'] / 2**20:>12.0f} {err:>11} {fb:>9}  {res}")
    lines.append(f"compute only (each attention on local K/V, no exchange): {compute * 1e3:.1f} ms "
                 "per forward; limit = max(compute only, a machine's inter-machine bytes at "
                 + (f"{cfg.link_mbit:g} Mbit/s)" if cfg.link_mbit else "the link rate: no "
                    "--link-mbit given)"))
    fell_back = {r["strategy"]: r["fallbacks"] for r in result["rows"] if r["fallbacks"]}
    if fell_back:
        lines.append("fallbacks (calls on SGLang's path, max over ranks): "
                     + "; ".join(f"{s}: {f}" for s, f in fell_back.items()))
    if result["skipped"]:
        reasons = sorted(set(result["skipped"].values()))
        lines.append(f"skipped SGLang's {', '.join(result['skipped'])}: " + "; ".join(reasons))
    return "\n".join(lines)


def cmd_compare_sglang(args) -> int:
    """``swiftfusion compare --engine sglang``: returns the exit code (0: every row passed)."""
    import json
    topos: list[Topology] = []

    def make_config(topo: Topology) -> SglangCompareConfig:
        topos.append(topo)
        return config_from_args_sglang(args, topo)

    result, cfg, where = run_on_ranks(args, make_config, _rank, preload=(ATTENTION,))
    rows = result["rows"]
    if where is None:  # not the reporting rank
        return 0 if all(r["passed"] is not False for r in rows) else 1
    print(format_table(result, cfg, topos[0], where))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{**{k: r[k] for k in JSON_FIELDS}, "ran_as": r["ran_as"],
                        "engine": PREFIX if parse_split(r["strategy"]) else "swiftfusion",
                        "fallbacks": r["fallbacks"],
                        "link_s": link_seconds(r, topos[0], cfg.link_mbit),
                        "compute_only_s": result["compute_s"]} for r in rows], f, indent=2)
    if args.plot:
        from .compare import write_plot
        write_plot([CompareRow(**{k: v for k, v in r.items() if k != "fallbacks"}) for r in rows],
                   args.plot, f"{cfg.model} (SGLang), {where}")
    return 0 if all(r["passed"] is not False for r in rows) else 1


__all__ = ["COMPUTE", "HEADS", "OURS", "SglangCompareConfig", "build_model", "cmd_compare_sglang",
           "config_from_args_sglang", "format_table", "import_sglang", "local_attention",
           "parse_split", "run_compare_sglang", "select", "sglang_splits", "split_name",
           "time_uspattention"]
