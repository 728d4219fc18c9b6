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

Columns as ``swiftfusion compare`` (``compare.CompareRow``); attention latency: one call of
diffusers' ``dispatch_attention_fn`` (one attention layer, communication included). Inter-node
bytes (attention only, both engines; the hooks' split/gather of the model's inputs and output
is the same for both and not counted): ours from ``ctx.stats()["inter_node_bytes"]``,
diffusers' from the volume model ``modelled_diffusers_bytes``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import asdict
from typing import Iterator

import torch
import torch.distributed as dist

from ..mesh import Mesh
from ..topology import Topology, detect_topology
from .compare import (DTYPES, JSON_FIELDS, AttentionCalls, CompareArgumentError, CompareConfig,
                      CompareRow, _aggregate, _effective, _Measure, _mesh_label,
                      _sync, config_from_args, format_table, load_with_reference,
                      run_on_ranks, time_calls,
                      write_plot)
from .diffusers_backend import ring_backend
from .measure import PeakMemory
from .quiet import quiet_rank

DIFFUSERS_CONFIGS = ("ulysses", "ring", "unified")
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


def run_compare_diffusers(cfg: CompareConfig) -> list[CompareRow]:
    """Collective over the default process group; every rank returns the same rows."""
    import diffusers

    from .models.parallel import generate_latents
    diffusers.utils.logging.set_verbosity_error()  # enable_parallelism warns on every call
    ring_backend(device_type())  # registered before our routing wraps the backends
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = DTYPES[cfg.dtype]
    topo = detect_topology(world, cfg.topology)
    pipe, heads, gen_kwargs, reference = load_with_reference(cfg)
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
                latents = generate_latents(pipe, cfg.kind, on_step=on_step, **gen_kwargs)
            m.peak = max(m.peak, mem.stop())
            if ctx is None:
                m.ran_as, m.mesh = name, diffusers_mesh_label(topo, *degrees)
                sent = modelled_diffusers_bytes(topo, *degrees, attn.shapes, rank)
            else:
                sent = ctx.stats()["inter_node_bytes"]
                m.ran_as, mesh = _effective(ctx)
                m.mesh = _mesh_label(mesh)
        m.add_round(stamps, attn.durations, sent, cfg.steps, latents, reference)
    return _aggregate(measures, dtype)


def _rank(cfg: CompareConfig) -> list[dict]:
    quiet_rank(dist.get_rank())  # the table is the output
    return [asdict(r) for r in run_compare_diffusers(cfg)]


def select(requested: str | None, topo: Topology, heads: int) -> tuple[list[str], list[str]]:
    """(rows to run, diffusers configs skipped as invalid here). ``requested``: comma-separated
    diffusers configs (``ulysses`` or ``diffusers:ulysses``) and our strategies; default all."""
    if requested:
        wanted = [s.strip().removeprefix(PREFIX) for s in requested.split(",") if s.strip()]
    else:
        wanted = [*DIFFUSERS_CONFIGS, *OURS]
    bad = [s for s in wanted if s not in DIFFUSERS_CONFIGS + OURS]
    if bad or not wanted:
        raise CompareArgumentError(f"unknown configuration {', '.join(bad) or '(none given)'}; "
                                   f"choose from {', '.join(DIFFUSERS_CONFIGS + OURS)}")
    invalid = [s for s in wanted if s in DIFFUSERS_CONFIGS
               and diffusers_degrees(s, topo, heads) is None]
    if requested and invalid:
        why = ring_backend(device_type())[1]
        raise CompareArgumentError(f"diffusers' {', '.join(invalid)} cannot run with {heads} heads "
                                   f"on {topo} here (ulysses: heads % ranks == 0; unified: "
                                   "1 < GPUs per machine < ranks, heads % GPUs per machine == 0"
                                   + (f"; ring and unified: {why})" if why else ")"))
    rows = [PREFIX + s for s in DIFFUSERS_CONFIGS if s in wanted and s not in invalid]
    return rows + [s for s in OURS if s in wanted], invalid


def config_from_args_diffusers(args, topo: Topology) -> tuple[CompareConfig, list[str]]:
    """Validate flags (model, sizes as ``compare``) and pick the rows; (config, skipped)."""
    import json
    from pathlib import Path
    base = config_from_args(argparse_copy(args, strategies="tas"), topo.world_size)
    if base.kind != "flux":
        raise CompareArgumentError(f"compare-diffusers runs Flux checkpoints; {args.model} is "
                                   f"{base.kind}")
    if base.max_sequence_length % topo.world_size:
        raise CompareArgumentError(
            f"--max-sequence-length {base.max_sequence_length}: diffusers shards Flux's text "
            f"with the image, so it must be a multiple of the {topo.world_size} ranks")
    tcfg = json.loads((Path(base.path) / "transformer" / "config.json").read_text())
    rows, skipped = select(args.strategies, topo, int(tcfg["num_attention_heads"]))
    return dataclasses.replace(base, strategies=rows), skipped


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
    table_rows = [CompareRow(**r) for r in rows]
    print(format_table(table_rows, cfg, where + ", diffusers pipeline"))
    if skipped:
        why = ring_backend(device_type())[1]
        print(f"skipped diffusers' {', '.join(skipped)}: invalid for this world size and head "
              "count" + (f", or (ring, unified) {why}" if why else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{**{k: r[k] for k in JSON_FIELDS},
                        "engine": "diffusers" if r["strategy"].startswith(PREFIX)
                        else "swiftfusion"} for r in rows], f, indent=2)
    if args.plot:
        write_plot(table_rows, args.plot, f"{cfg.model} (diffusers pipeline), {where}")
    return 0 if all(r.passed is not False for r in table_rows) else 1


__all__ = ["DIFFUSERS_CONFIGS", "OURS", "cmd_compare_diffusers", "config_from_args_diffusers",
           "device_type", "diffusers_degrees", "diffusers_device_mesh", "diffusers_mesh_label",
           "layer_backend", "layer_config", "modelled_diffusers_bytes", "run_compare_diffusers",
           "select", "time_dispatch_calls"]
