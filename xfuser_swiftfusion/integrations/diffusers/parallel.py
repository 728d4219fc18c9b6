"""``enable_parallelism`` / ``disable_parallelism``: a diffusers model's context parallelism with
a SwiftFusion strategy doing the attention.

diffusers' own hooks (the model's ``_cp_plan``, fitted to the model: ``plans``) split the
sequence over the default process group and gather the output; the routed attention backends
(``routing``) send every context-parallel attention call to the strategy's
``SequenceParallelContext``, or to the path its tokens call for (``sites``: attention modules
whose tokens the plan leaves whole on every rank).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...context import SequenceParallelContext, init_sequence_parallel
from ...log import get_logger
from ...strategies import get as get_spec
from ...topology import Topology
from . import plans, routing, sharding, sites

logger = get_logger(__name__)

STATE_ATTR = "_swiftfusion_parallelism"
_lock = threading.Lock()


@dataclass
class _Enabled:
    """What ``disable_parallelism`` undoes on one model."""

    ctx: SequenceParallelContext
    config: object         # diffusers' ParallelConfig the route is attached to
    owns_config: bool      # enable_parallelism turned diffusers' context parallelism on
    route: routing.Route
    site_hooks: list       # forward hooks marking the modules of ``plans.REPLICATED``


def enable_parallelism(model: torch.nn.Module, strategy: str = "swiftfusion",
                       topology: str | Topology | None = None, *, num_heads: int | None = None,
                       ulysses_degree: int | None = None, ring_degree: int | None = None,
                       timeout_s: float | None = None, comm: str = "auto",
                       cp_plan: dict | None = None,
                       options: dict | None = None) -> SequenceParallelContext:
    """Run ``model`` (a diffusers ``ModelMixin`` with a ``_cp_plan``) context-parallel over the
    default process group, its attention on ``strategy``; return the strategy's context.

    Call on every rank after ``torch.distributed`` is initialised (collective). The model's
    sequence inputs are split by diffusers' ``_cp_plan`` hooks into equal contiguous chunks,
    chunk i on rank i, and its outputs gathered, so the model is called with and returns full
    tensors on every rank, exactly as with ``model.enable_parallelism(config=...)``. A model
    whose diffusers context parallelism is already on over the whole group (e.g. loaded with
    ``from_pretrained(..., parallel_config=...)``) keeps its sharding; only its attention moves.

    ``topology``: ``"NxM"`` machines x GPUs (else ``$SWIFTFUSION_TOPOLOGY``, else detected).
    ``num_heads``: the head count the mesh is planned for (default: the model's
    ``num_attention_heads``). ``ulysses_degree``/``ring_degree``, ``timeout_s``, ``comm``,
    ``options``: as ``init_sequence_parallel``. ``cp_plan``: overrides the model's ``_cp_plan``
    (either fitted to the model: entries beyond its blocks dropped, ``plans.PlanError`` for a
    module it lacks).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"enable_parallelism takes a diffusers model (e.g. pipe.transformer), got "
                        f"{type(model).__name__}")
    spec = get_spec(strategy)
    if spec.external_groups:
        raise ValueError(f"strategy {strategy!r} runs on xFuser's process groups; with diffusers "
                         "the baseline is diffusers' own context parallelism: "
                         "model.enable_parallelism(config=ContextParallelConfig(...))")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("enable_parallelism needs torch.distributed initialised (torchrun, "
                           "then dist.init_process_group) on every rank")
    world = dist.get_world_size()
    name = type(model).__name__
    if world < 2:
        raise ValueError(f"context parallelism needs at least 2 ranks; the default process group "
                         f"has {world}")
    heads = num_heads if num_heads is not None else sharding.model_heads(model)
    with _lock:
        if getattr(model, STATE_ATTR, None) is not None:
            raise RuntimeError(f"{name} already runs a SwiftFusion strategy; call "
                               "disable_parallelism(model) first")
        config = getattr(model, "_parallel_config", None)
        owns = config is None
        if owns:
            plan = plans.plan_for(model, cp_plan)
        else:
            sharding.check_adoptable(model, config, world)
            plan = cp_plan or getattr(model, "_cp_plan", None) or {}
        # auto never picks a strategy on xFuser's groups here (diffusers runs without xFuser)
        ctx = init_sequence_parallel(strategy, heads, topology, ulysses_degree=ulysses_degree,
                                     ring_degree=ring_degree, timeout_s=timeout_s, comm=comm,
                                     options={"external": False, **(options or {})})
        try:
            if owns:
                config = _enable_diffusers_cp(model, world, plan)
            sharding.add_uneven_error_hook(model, world, plan)
        except BaseException:
            sharding.remove_uneven_error_hook(model)
            if owns:
                sharding.remove_diffusers_cp(model)
            ctx.close()
            raise
        route = routing.Route(ctx, world, name)
        routing.install()
        routing.attach(config, route)
        hooks = sites.install(plans.replicated_sites(model))
        setattr(model, STATE_ATTR, _Enabled(ctx, config, owns, route, hooks))
    logger.info(f"rank {ctx.rank}: {name} context-parallel over {world} ranks, attention on "
                f"{ctx.strategy} ({ctx.mesh.describe()}, topology {ctx.topology})")
    return ctx


def _enable_diffusers_cp(model: torch.nn.Module, world: int, plan: dict):
    """diffusers' context parallelism over the default group in rank order; its config."""
    from diffusers import ContextParallelConfig
    config = ContextParallelConfig(ulysses_degree=world, mesh=sharding.cp_mesh(world))
    with sharding.accelerator_count_at_least_one():
        model.enable_parallelism(config=config, cp_plan=plan)
    return model._parallel_config


def disable_parallelism(model: torch.nn.Module) -> None:
    """Undo ``enable_parallelism``: diffusers' attention again and, if ``enable_parallelism``
    turned it on, no context parallelism (the model runs whole on every rank); the context is
    closed. Idempotent."""
    with _lock:
        state: _Enabled | None = getattr(model, STATE_ATTR, None)
        if state is None:
            return
        delattr(model, STATE_ATTR)
        sites.remove(state.site_hooks)
        routing.detach(state.config)
        routing.uninstall()
        sharding.remove_uneven_error_hook(model)
        if state.owns_config:
            sharding.remove_diffusers_cp(model)
    stats = state.ctx.stats()
    logger.info(f"rank {state.ctx.rank}: {type(model).__name__}: {stats['strategy']} "
                f"({stats['mesh']}): attention calls {_paths(state.route)}, fallbacks "
                f"{stats['fallbacks']}")
    state.ctx.close()


def context_of(model: torch.nn.Module) -> SequenceParallelContext | None:
    """The context ``model``'s attention runs on, or None."""
    state = getattr(model, STATE_ATTR, None)
    return state.ctx if state is not None else None


def attention_paths(model: torch.nn.Module) -> dict[str, int]:
    """Routed attention calls of ``model`` since ``enable_parallelism``, per path that ran
    (``routing.PATHS``: ``strategy``, ``key-masked`` (strategy calls with a key mask),
    ``local``, ``merged``, ``gathered``), paths without calls left out; {} when not enabled."""
    state = getattr(model, STATE_ATTR, None)
    return _paths(state.route) if state is not None else {}


def _paths(route: routing.Route) -> dict[str, int]:
    return {p: route.paths[p] for p in routing.PATHS if route.paths[p]}


__all__ = ["attention_paths", "context_of", "disable_parallelism", "enable_parallelism"]
