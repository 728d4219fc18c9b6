"""``swiftfusion compare-diffusers``: a diffusers pipeline under diffusers' own context
parallelism and under SwiftFusion strategies, side by side, one launch.

Every rank loads the pipeline (no xFuser); rank 0 first runs it on one device (the
reference). Then each configuration denoises the same prompt from the same seed, the
configurations interleaved over ``repeats`` rounds:

- ``diffusers:ulysses`` / ``diffusers:ring`` / ``diffusers:unified``: ``transformer.
  enable_parallelism(config=ContextParallelConfig(ulysses_degree=U, ring_degree=R))`` over a
  ``("ring", "ulysses")`` mesh of shape ``(R, U)`` in rank order (Ulysses groups: consecutive
  ranks). Ulysses: ``U = W`` (needs ``heads % W == 0``); ring: ``R = W``; unified: ``U`` = GPUs
  per machine, ``R`` = machines (needs ``1 < U < W`` and ``heads % U == 0``). Ring and unified
  merge blocks by log-sum-exp and run on an LSE backend (``diffusers_backend.ring_backend``:
  ``_native_flash`` on CUDA, our ``sf_cpu_lse`` on CPU); Ulysses on the model's own backend.
- ``tas`` / ``torus`` / ``swiftfusion`` / ``auto``: ``integrations.diffusers.enable_parallelism``
  (diffusers' sharding hooks, attention on the strategy).

Models: Flux checkpoints (``tiny-flux`` or a local FLUX.1 directory), and ``tiny-qwenimage``
(``diffusers_qwenimage``), whose pipeline masks padded prompts: ``--prompt-padding N`` runs a
batch of two prompts, the second N tokens shorter, padded and masked as the pipeline pads
them; the strategies apply the mask in their own attention (each strategy's
``ctx.stats()["fallbacks"]`` is printed under the table). diffusers' ring and unified
attention apply a mask unchanged to every key block (wrong), so those rows are skipped for
masked prompts.

Columns as ``swiftfusion compare`` (``compare.CompareRow``); attention latency: one call of
diffusers' ``dispatch_attention_fn`` (one attention layer, communication included). Inter-node
bytes (attention only, both engines; the hooks' split/gather of the model's inputs and output
is the same for both and not counted): ours from ``ctx.stats()["inter_node_bytes"]``,
diffusers' from the volume model ``modelled_diffusers_bytes``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from dataclasses import asdict
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from ..mesh import Mesh
from ..topology import Topology, detect_topology
from . import diffusers_qwenimage as qwenimage
from .compare import (DTYPES, JSON_FIELDS, AttentionCalls, CompareArgumentError, CompareConfig,
                      CompareRow, _aggregate, _device, _effective, _Measure, _mesh_label,
                      _sync, config_from_args, format_table, load_with_reference,
                      run_on_ranks, time_calls,
                      write_plot)
from .diffusers_backend import ring_backend
from .measure import PeakMemory
from .quiet import quiet_rank

@dataclasses.dataclass
class DiffusersCompareConfig(CompareConfig):
    prompt_padding: int | None = None  # tiny-qwenimage: the second prompt this much shorter


DIFFUSERS_CONFIGS = ("ulysses", "ring", "unified")
MASKED_SKIPS = ("ring", "unified")  # apply a mask unchanged to every key block
OURS = ("tas", "torus", "swiftfusion", "auto")
PREFIX = "diffusers:"
TEXT_TOKENS = 16   # Flux's text is sharded with the image: a multiple of common world sizes


def device_type() -> str:
    """The device type diffusers' context parallelism runs on here (``cpu`` without CUDA)."""
    return torch._C._get_accelerator().type


def diffusers_degrees(config: str, topo: Topology, heads: int,
                      lse_backend: bool | None = None) -> tuple[int, int] | None:
    """``(ring, ulysses)`` degrees of diffusers' ``config`` on ``topo``, or None if invalid
    (configs with a ring need an ``lse_backend``, default: ``ring_backend`` finds one here)."""
    world, gpus = topo.world_size, topo.gpus_per_node
    if lse_backend is None:
        lse_backend = ring_backend(device_type())[0] is not None
    if config in DIFFUSERS_CONFIGS[1:] and not lse_backend:
        return None
    if config == "ulysses":
        return (1, world) if heads % world == 0 else None
    if config == "ring":
        return world, 1
    if config == "unified":
        ok = 1 < gpus < world and heads % gpus == 0
        return (world // gpus, gpus) if ok else None
    raise ValueError(f"unknown diffusers config {config!r}; choose from {DIFFUSERS_CONFIGS}")


def diffusers_mesh(topo: Topology, ring: int, ulysses: int) -> Mesh:
    """diffusers' ``(ring, ulysses)`` rank-order mesh: Ulysses on adjacent ranks, USP's placement."""
    return Mesh(topo, ulysses, ring, "usp")


def diffusers_mesh_label(topo: Topology, ring: int, ulysses: int) -> str:
    """The ``UxRxT`` label (``compare._mesh_label``) of diffusers' mesh."""
    return _mesh_label(diffusers_mesh(topo, ring, ulysses))


def modelled_diffusers_bytes(topo: Topology, ring: int, ulysses: int,
                             shapes: list[tuple[int, int, int, int, int]], rank: int) -> int:
    """Inter-machine bytes ``rank`` sends in diffusers' templated attention for the recorded
    calls (query shapes ``(B, S_local, H, D, bytes per element)``).

    Ulysses: all-to-all of Q, K, V and of the output over the Ulysses group, 1/U of each
    tensor to every peer. Ring (``rotate_method="allgather"``): K and V (after the Ulysses
    all-to-all: the same element count) all-gathered over the ring group by the ring
    algorithm in group-rank order (gloo's; NCCL's ring may order ranks otherwise): each rank
    forwards ``R - 1`` blocks to the next rank of its group. Only sends to another machine
    count (checked against the kernel's qdisc counters by ``scripts/bench_layer.py``).
    """
    mesh = diffusers_mesh(topo, ring, ulysses)
    g, r = mesh.g_r_of(rank)
    ulysses_group, ring_group = mesh.ulysses_groups[r], mesh.ring_groups[g]
    node = topo.node_of(rank)
    u_far = sum(topo.node_of(p) != node for p in ulysses_group)
    successor = ring_group[(ring_group.index(rank) + 1) % len(ring_group)]
    r_far = (ring - 1) * (topo.node_of(successor) != node)
    total = 0
    for B, S, H, D, size in shapes:
        n = B * S * H * D * size
        total += 4 * u_far * n // ulysses + 2 * r_far * n
    return total


def time_dispatch_calls() -> contextlib.AbstractContextManager[AttentionCalls]:
    """Time every call of diffusers' ``dispatch_attention_fn`` (shapes ``[B, S, H, D]``)."""
    from diffusers.models import attention_dispatch
    return time_calls(attention_dispatch, "dispatch_attention_fn", "diffusers")


_meshes: dict[tuple[int, int], object] = {}


def diffusers_device_mesh(ring: int, ulysses: int):
    """diffusers' ``("ring", "ulysses")`` DeviceMesh of shape ``(ring, ulysses)`` over the
    default group in rank order (``diffusers_mesh``'s placement); collective the first time,
    then cached."""
    from torch.distributed.device_mesh import init_device_mesh
    if (ring, ulysses) not in _meshes:
        _meshes[ring, ulysses] = init_device_mesh(device_type(), (ring, ulysses),
                                                  mesh_dim_names=("ring", "ulysses"))
    return _meshes[ring, ulysses]


def layer_config(ring: int, ulysses: int):
    """A set-up diffusers ``ParallelConfig`` for ``dispatch_attention_fn`` at the layer level
    (no model): what ``enable_parallelism`` gives every attention processor."""
    from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig
    config = ParallelConfig(context_parallel_config=ContextParallelConfig(
        ring_degree=ring, ulysses_degree=ulysses))
    config.setup(dist.get_rank(), dist.get_world_size(), torch.device(device_type()),
                 mesh=diffusers_device_mesh(ring, ulysses))
    return config


def layer_backend(ring: int) -> str:
    """The diffusers backend a layer runs on: an LSE backend with a ring, else ``native``."""
    if ring == 1:
        return "native"
    name, why = ring_backend(device_type())
    if name is None:
        raise RuntimeError(f"diffusers' ring attention cannot run here: {why}")
    return name


@contextlib.contextmanager
def diffusers_session(model: torch.nn.Module, ring: int, ulysses: int) -> Iterator[None]:
    """diffusers' own context parallelism on ``model`` for the duration (mesh built once).
    With a ring the model runs on ``layer_backend``; diffusers' active backend, which
    ``set_attention_backend`` changes process-wide, is put back afterwards."""
    from diffusers import ContextParallelConfig
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    from ..integrations.diffusers import sharding
    config = ContextParallelConfig(ring_degree=ring, ulysses_degree=ulysses,
                                   mesh=diffusers_device_mesh(ring, ulysses))
    active = _AttentionBackendRegistry._active_backend
    if ring > 1:
        model.set_attention_backend(layer_backend(ring))
    try:
        with sharding.accelerator_count_at_least_one():
            model.enable_parallelism(config=config)
        yield
    finally:
        sharding.remove_diffusers_cp(model)
        if ring > 1:
            model.reset_attention_backend()
            _AttentionBackendRegistry.set_active_backend(active)


@contextlib.contextmanager
def _session(model: torch.nn.Module, name: str, topo: Topology, heads: int,
             cfg: CompareConfig) -> Iterator[tuple[object | None, tuple[int, int] | None]]:
    """``name`` enabled on ``model``: yields (our context, None) or (None, diffusers' degrees)."""
    from ..integrations import diffusers as sfd
    if name.startswith(PREFIX):
        degrees = diffusers_degrees(name.removeprefix(PREFIX), topo, heads)
        with diffusers_session(model, *degrees):
            yield None, degrees
        return
    ctx = sfd.enable_parallelism(model, strategy=name, topology=cfg.topology,
                                 timeout_s=cfg.timeout_s)
    try:
        ctx.reset_stats()
        yield ctx, None
    finally:
        sfd.disable_parallelism(model)


def _load(cfg: DiffusersCompareConfig) -> tuple[object, int, dict, torch.Tensor | None,
                                                Callable[..., torch.Tensor]]:
    """Collective: (pipe, heads, generation kwargs, rank 0's single-device latents or None,
    the generation function)."""
    from .models.parallel import generate_latents
    if cfg.kind != qwenimage.KIND:
        return (*load_with_reference(cfg), functools.partial(generate_latents, kind=cfg.kind))
    pipe = qwenimage.load(DTYPES[cfg.dtype], _device(), cfg.seed)
    gen_kwargs = dict(height=cfg.height, width=cfg.width, steps=cfg.steps, seed=cfg.seed,
                      max_sequence_length=cfg.max_sequence_length,
                      prompt_padding=cfg.prompt_padding)
    reference = None
    if cfg.reference and dist.get_rank() == 0:
        reference = qwenimage.generate_latents(pipe, **gen_kwargs).double()
    dist.barrier()
    return pipe, qwenimage.HEADS, gen_kwargs, reference, qwenimage.generate_latents


def run_compare_diffusers(cfg: DiffusersCompareConfig
                          ) -> tuple[list[CompareRow], dict[str, dict[str, int]]]:
    """Collective over the default process group; every rank returns the same rows and, per
    strategy row, rank 0's ``ctx.stats()["fallbacks"]`` summed over rounds."""
    import diffusers

    diffusers.utils.logging.set_verbosity_error()  # enable_parallelism warns on every call
    ring_backend(device_type())  # registered before our routing wraps the backends
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = DTYPES[cfg.dtype]
    topo = detect_topology(world, cfg.topology)
    pipe, heads, gen_kwargs, reference, generate_latents = _load(cfg)
    fallbacks: dict[str, dict[str, int]] = {s: {} for s in cfg.strategies if s in OURS}
    measures = {s: _Measure() for s in cfg.strategies}
    for _, name in [(r, s) for r in range(cfg.repeats) for s in cfg.strategies]:
        m = measures[name]
        stamps: list[float] = []

        def on_step(_i: int) -> None:
            _sync()
            stamps.append(time.perf_counter())

        with _session(pipe.transformer, name, topo, heads, cfg) as (ctx, degrees):
            mem = PeakMemory().start()
            with time_dispatch_calls() as attn:
                latents = generate_latents(pipe, on_step=on_step, **gen_kwargs)
            m.peak = max(m.peak, mem.stop())
            if ctx is None:
                m.ran_as, m.mesh = name, diffusers_mesh_label(topo, *degrees)
                sent = modelled_diffusers_bytes(topo, *degrees, attn.shapes, rank)
            else:
                sent = ctx.stats()["inter_node_bytes"]
                m.ran_as, mesh = _effective(ctx)
                m.mesh = _mesh_label(mesh)
                for reason, n in ctx.stats()["fallbacks"].items():
                    fallbacks[name][reason] = fallbacks[name].get(reason, 0) + n
        m.add_round(stamps, attn.durations, sent, cfg.steps, latents, reference)
    every: list = [None] * world
    dist.all_gather_object(every, fallbacks)
    return _aggregate(measures, dtype), every[0]


def _rank(cfg: CompareConfig) -> list[dict]:
    quiet_rank(dist.get_rank())  # the table is the output
    rows, fallbacks = run_compare_diffusers(cfg)
    return [{**asdict(r), "fallbacks": fallbacks.get(r.strategy)} for r in rows]


def select(requested: str | None, topo: Topology, heads: int,
           masked: bool = False) -> tuple[list[str], list[str]]:
    """(rows to run, diffusers configs skipped as invalid here). ``requested``: comma-separated
    diffusers configs (``ulysses`` or ``diffusers:ulysses``) and our strategies; default all.
    ``masked``: the prompts carry a mask (``MASKED_SKIPS`` are invalid)."""
    if requested:
        wanted = [s.strip().removeprefix(PREFIX) for s in requested.split(",") if s.strip()]
    else:
        wanted = [*DIFFUSERS_CONFIGS, *OURS]
    bad = [s for s in wanted if s not in DIFFUSERS_CONFIGS + OURS]
    if bad or not wanted:
        raise CompareArgumentError(f"unknown configuration {', '.join(bad) or '(none given)'}; "
                                   f"choose from {', '.join(DIFFUSERS_CONFIGS + OURS)}")
    invalid = [s for s in wanted if s in DIFFUSERS_CONFIGS
               and (diffusers_degrees(s, topo, heads) is None or (masked and s in MASKED_SKIPS))]
    if requested and invalid:
        why = ring_backend(device_type())[1]
        raise CompareArgumentError(f"diffusers' {', '.join(invalid)} cannot run with {heads} heads "
                                   f"on {topo} here (ulysses: heads % ranks == 0; unified: "
                                   "1 < GPUs per machine < ranks, heads % GPUs per machine == 0"
                                   + (f"; ring and unified: {why}" if why else "")
                                   + ("; ring and unified: no masked prompts)" if masked else ")"))
    rows = [PREFIX + s for s in DIFFUSERS_CONFIGS if s in wanted and s not in invalid]
    return rows + [s for s in OURS if s in wanted], invalid


def add_arguments(p) -> None:
    """Flags of ``compare-diffusers`` besides ``compare``'s."""
    p.add_argument("--prompt-padding", type=int, metavar="N",
                   help=f"{qwenimage.NAME}: a batch of two prompts, the second N tokens shorter, "
                        "padded and masked as the pipeline pads them (the strategies apply the "
                        "text mask)")


def config_from_args_diffusers(args, topo: Topology) -> tuple[DiffusersCompareConfig, list[str]]:
    """Validate flags (model, sizes as ``compare``) and pick the rows; (config, skipped)."""
    import json
    from pathlib import Path
    padding = getattr(args, "prompt_padding", None)
    if args.model.strip() == qwenimage.NAME:
        return _qwenimage_config(args, topo, padding)
    base = config_from_args(argparse_copy(args, strategies="tas"), topo.world_size)
    if base.kind != "flux":
        raise CompareArgumentError(f"compare-diffusers runs Flux checkpoints and "
                                   f"{qwenimage.NAME}; {args.model} is {base.kind}")
    if padding is not None:
        raise CompareArgumentError(f"--prompt-padding: Flux's pipeline passes no text mask (it "
                                   f"attends the padding); use --model {qwenimage.NAME}")
    if base.max_sequence_length % topo.world_size:
        raise CompareArgumentError(
            f"--max-sequence-length {base.max_sequence_length}: diffusers shards Flux's text "
            f"with the image, so it must be a multiple of the {topo.world_size} ranks")
    tcfg = json.loads((Path(base.path) / "transformer" / "config.json").read_text())
    rows, skipped = select(args.strategies, topo, int(tcfg["num_attention_heads"]))
    return DiffusersCompareConfig(**{**dataclasses.asdict(base), "strategies": rows}), skipped


def _qwenimage_config(args, topo: Topology, padding: int | None
                      ) -> tuple[DiffusersCompareConfig, list[str]]:
    """``config_from_args``'s checks for ``tiny-qwenimage`` (not a checkpoint directory)."""
    if args.steps < 2:
        raise CompareArgumentError("--steps must be >= 2 (step 1 is not timed)")
    height, width = args.height or qwenimage.DEFAULT_SIZE[0], args.width or qwenimage.DEFAULT_SIZE[1]
    try:
        qwenimage.check_shapes(height, width, args.max_sequence_length, padding, topo.world_size)
    except ValueError as exc:
        raise CompareArgumentError(str(exc)) from None
    rows, skipped = select(args.strategies, topo, qwenimage.HEADS, masked=padding is not None)
    dtype = args.dtype or ("bf16" if torch.cuda.is_available() else "fp32")
    return DiffusersCompareConfig(
        model=qwenimage.NAME, kind=qwenimage.KIND, path="", strategies=rows, steps=args.steps,
        height=height, width=width, num_frames=1, prompt="(random prompt embeddings)",
        max_sequence_length=args.max_sequence_length, guidance_scale=1.0, seed=args.seed,
        repeats=args.repeats, dtype=dtype, topology=args.topology, timeout_s=args.timeout,
        reference=not args.no_reference, prompt_padding=padding), skipped


def argparse_copy(args, **changes):
    """A copy of an ``argparse.Namespace`` with ``changes``."""
    import argparse
    return argparse.Namespace(**{**vars(args), **changes})


def cmd_compare_diffusers(args) -> int:
    """``swiftfusion compare-diffusers``: returns the exit code (0: every row passed)."""
    import json
    skipped: list[str] = []

    def make_config(topo):
        cfg, names = config_from_args_diffusers(args, topo)
        skipped.extend(names)
        return cfg

    rows, cfg, where = run_on_ranks(args, make_config, _rank)
    if where is None:  # not the reporting rank
        return 0 if all(r["passed"] is not False for r in rows) else 1
    table_rows = [CompareRow(**{k: v for k, v in r.items() if k != "fallbacks"}) for r in rows]
    print(format_table(table_rows, cfg, where + ", diffusers pipeline"))
    if cfg.prompt_padding is not None:
        print(f"prompts: 2, the second {cfg.prompt_padding} of {cfg.max_sequence_length} text "
              "tokens shorter (padded, masked by the pipeline)")
    fell_back = {r["strategy"]: r["fallbacks"] for r in rows if r["fallbacks"]}
    print("fallbacks (rank 0): " + ("; ".join(f"{s}: {f}" for s, f in fell_back.items())
                                     if fell_back else "none: every attention call of "
                                     f"{', '.join(s for s in OURS if s in cfg.strategies)} "
                                     "ran on the strategy's own path"))
    if skipped:
        why = ring_backend(device_type())[1]
        masked = cfg.prompt_padding is not None and any(s in MASKED_SKIPS for s in skipped)
        print(f"skipped diffusers' {', '.join(skipped)}: invalid for this world size and head "
              "count" + (f", or (ring, unified) {why}" if why else "")
              + (", or (ring, unified) masked prompts: they apply a mask unchanged to every key "
                 "block" if masked else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{**{k: r[k] for k in JSON_FIELDS},
                        "engine": "diffusers" if r["strategy"].startswith(PREFIX)
                        else "swiftfusion", "fallbacks": r["fallbacks"]} for r in rows],
                      f, indent=2)
    if args.plot:
        write_plot(table_rows, args.plot, f"{cfg.model} (diffusers pipeline), {where}")
    return 0 if all(r.passed is not False for r in table_rows) else 1


__all__ = ["DIFFUSERS_CONFIGS", "DiffusersCompareConfig", "MASKED_SKIPS", "OURS",
           "add_arguments", "cmd_compare_diffusers", "config_from_args_diffusers",
           "device_type", "diffusers_degrees", "diffusers_device_mesh", "diffusers_mesh_label",
           "layer_backend", "layer_config", "modelled_diffusers_bytes", "run_compare_diffusers",
           "select", "time_dispatch_calls"]
