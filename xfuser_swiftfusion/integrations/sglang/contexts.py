"""Our contexts over SGLang's sequence-parallel group, one per head count, made on first use.

The SP group is SGLang's (``parallel_state.get_sp_group()``: its global ranks in SP-rank order,
the order SGLang shards the sequence in); the mesh on it is this project's (Ulysses across
machines, Ring inside, from the machines the ranks run on), not SGLang's ``--ulysses-degree`` /
``--ring-degree``. Making a context is collective over the default process group, so it happens
in the first attention call every rank makes with that head count; SGLang's SP groups must cover
the default group (no tensor-, pipeline- or VAE-parallel ranks beside them), else every call stays
SGLang's (``groups_unsupported``).
"""
from __future__ import annotations

import threading

import torch.distributed as dist

from ...context import SequenceParallelContext, init_sequence_parallel
from ...log import get_logger
from .config import Config

logger = get_logger(__name__)

_contexts: dict[int, SequenceParallelContext] = {}
_lock = threading.Lock()


def sp_world_size() -> int:
    from sglang.multimodal_gen.runtime.distributed import parallel_state as ps
    return ps.get_sequence_parallel_world_size()


def sp_ranks() -> list[int]:
    from sglang.multimodal_gen.runtime.distributed import parallel_state as ps
    return list(ps.get_sp_group().ranks)


def groups_unsupported() -> str | None:
    """Why our strategies cannot run on SGLang's SP groups here (None: they can)."""
    from sglang.multimodal_gen.runtime.distributed import parallel_state as ps
    world, sp = dist.get_world_size(), sp_world_size()
    if ps.get_tp_world_size() != 1:
        return "tensor parallelism beside sequence parallelism"
    if world % sp:
        return f"SP groups of {sp} ranks do not tile the {world} ranks"
    return None


def context(heads: int, config: Config) -> SequenceParallelContext:
    """The context for ``heads`` query heads (collective on first use)."""
    with _lock:
        ctx = _contexts.get(heads)
        if ctx is None:
            ranks = sp_ranks()
            ctx = init_sequence_parallel(
                config.strategy, heads, comm=config.comm, options=config.options,
                ranks=None if len(ranks) == dist.get_world_size() else ranks)
            _contexts[heads] = ctx
            if ctx.rank == 0:
                logger.info(f"SGLang attention ({heads} heads) on {ctx.strategy}, "
                            f"topology {ctx.topology}, mesh {ctx.mesh.describe()}")
        return ctx


def active() -> dict[int, SequenceParallelContext]:
    """The contexts made so far, by head count."""
    return dict(_contexts)


def close_all() -> None:
    """Close every context (collective for one-sided strategies); idempotent."""
    with _lock:
        for ctx in _contexts.values():
            ctx.close()
        _contexts.clear()
