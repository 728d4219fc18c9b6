"""The hooks on ``USPAttention.forward`` and on Qwen-Image's caller-side exchange (SGLang's
``HookType.AROUND``) and their bookkeeping.

Every call goes to SGLang's own ``forward`` unless a strategy is configured, SP is on (more than
one SP rank) and the call is one our strategies take (``calls.unsupported``); a call they do not
take runs SGLang's path, counted in the context's ``stats()["fallbacks"]`` and logged once per
reason. Under SGLang's breakable CUDA graphs the strategy runs inside an eager break, as SGLang's
own attention does (``_make_breakable_attention_forward``); under ``torch.compile`` it is one
graph break.
"""
from __future__ import annotations

import inspect
from collections import Counter

import torch

from ...log import get_logger, log_once
from . import calls, config, contexts

logger = get_logger(__name__)

TARGET = "sglang.multimodal_gen.runtime.layers.attention.layer.USPAttention.forward"
SHUTDOWN_TARGET = "sglang.multimodal_gen.runtime.distributed.parallel_state.destroy_model_parallel"
# Qwen-Image's caller-side Ulysses exchange of its joint q/k/v (CUDA IPC, Ulysses degree 2); its
# caller imports it from the module at each call, so a hook on the module attribute takes effect
PRE_EXCHANGE_TARGET = "sglang.multimodal_gen.runtime.layers.usp._ipc_input_a2a_qkv_segmented"

# fallbacks of calls made before any context exists (e.g. SP groups we cannot run on)
unbound_fallbacks: Counter = Counter()
_signature: list[inspect.Signature] = []


def _forward_signature(fn=None) -> inspect.Signature:
    """SGLang's ``USPAttention.forward`` signature, read through ``__wrapped__`` from ``fn`` (the
    function the hook wraps) or the class attribute: a wrapper without ``__wrapped__`` would
    hide the keyword arguments (a mask) that decide whether a call is ours."""
    if not _signature:
        from sglang.multimodal_gen.runtime.layers.attention.layer import USPAttention
        sig = inspect.signature(inspect.unwrap(fn or USPAttention.forward))
        if "attn_mask" not in sig.parameters:
            raise RuntimeError(f"USPAttention.forward reads as {sig}: a wrapper without "
                               "__wrapped__ (functools.wraps) hides SGLang's arguments")
        _signature.append(sig)
    return _signature[0]


def _fallback(reason: str, ctx=None) -> None:
    if ctx is not None:
        ctx.record_fallback(reason)
        rank = ctx.rank
    else:
        unbound_fallbacks[reason] += 1
        rank = 0
    if rank == 0:
        log_once(logger, f"sglang-fallback-{reason}",
                 f"SGLang attention calls with {reason} run SGLang's own path "
                 "(counted in stats()['fallbacks'])")


def _route(original_fn, cfg, args, kwargs):
    """The context to run this call on (made on first use: collective), or None after counting
    why SGLang's path runs it."""
    arguments = calls.bind(_forward_signature(original_fn), args, kwargs)
    heads = arguments["q"].shape[2]
    reason = contexts.groups_unsupported()
    if reason is not None:
        _fallback(reason)
        return None, arguments
    ctx = contexts.context(heads, cfg)
    reason = calls.unsupported(arguments)
    if reason is not None:
        _fallback(reason, ctx)
        return None, arguments
    return ctx, arguments


@torch.compiler.disable(recursive=True, reason="SwiftFusion attention runs eagerly")
def _eager(original_fn, cfg, args, kwargs):
    ctx, arguments = _route(original_fn, cfg, args, kwargs)
    if ctx is None:
        return original_fn(*args, **kwargs)
    return calls.run(calls.read(arguments), ctx.attention)


def _bcg_break(self, cfg, args, kwargs, *, out):
    """Inside SGLang's eager break (no capture under way): the strategy writes ``out``."""
    arguments = calls.bind(_forward_signature(), (self, *args), kwargs)
    ctx = contexts.context(arguments["q"].shape[2], cfg)
    out.copy_(calls.run(calls.read(arguments), ctx.attention))


_bcg_callable: list = []


def _in_bcg() -> bool:
    from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph import (
        is_in_breakable_cuda_graph,
    )
    return is_in_breakable_cuda_graph()


def _strategy_on(cfg) -> bool:
    """A strategy is configured and SP is on (more than one SP rank)."""
    return cfg.strategy is not None and contexts.sp_world_size() >= 2


def uspattention_forward(original_fn, *args, **kwargs):
    """AROUND hook: ``original_fn(self, q, k, v, ...)`` is SGLang's ``USPAttention.forward``."""
    cfg = config.current()
    if not _strategy_on(cfg):
        return original_fn(*args, **kwargs)
    if not _in_bcg():
        return _eager(original_fn, cfg, args, kwargs)
    # breakable CUDA graph: SGLang's own wrapper puts its attention in an eager break, ours
    # goes in one too (a context is made there, outside any capture)
    arguments = calls.bind(_forward_signature(original_fn), args, kwargs)
    reason = contexts.groups_unsupported() or calls.unsupported(arguments)
    if reason is not None:
        _fallback(reason, contexts.active().get(arguments["q"].shape[2]))
        return original_fn(*args, **kwargs)
    from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph import (
        eager_on_graph,
    )
    if not _bcg_callable:
        _bcg_callable.append(eager_on_graph(_bcg_break))
    self, rest = args[0], args[1:]
    out = self._new_bcg_output(*rest, **kwargs)
    _bcg_callable[0](self, cfg, rest, kwargs, out=out)
    return out


def decline_pre_exchange(original_fn, *args, **kwargs):
    """AROUND hook on SGLang's caller-side Ulysses exchange (``PRE_EXCHANGE_TARGET``): while a
    strategy runs SGLang's attention it answers None, the exchange's own "unavailable" answer, so
    the caller passes sequence-sharded q/k/v to ``USPAttention`` (its path without the IPC
    exchange) and the call runs on the strategy instead of arriving already exchanged
    (``qkv_pre_all_to_all``, which only SGLang's path can take)."""
    cfg = config.current()
    if not _strategy_on(cfg) or contexts.groups_unsupported() is not None:
        return original_fn(*args, **kwargs)
    return None


def close_contexts(*args, **kwargs):
    """BEFORE hook on SGLang's ``destroy_model_parallel``: our contexts go first."""
    contexts.close_all()
    return None
