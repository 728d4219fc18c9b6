"""diffusers' attention backends routed to a SwiftFusion context while context parallelism is on.

Every diffusers attention processor calls ``dispatch_attention_fn``, which looks the backend
function up in ``_AttentionBackendRegistry._backends`` at call time and passes it keyword
arguments only, ``_parallel_config`` among them for the backends that support context
parallelism. ``install`` wraps each such function once: a call whose ``_parallel_config``
carries a ``Route`` (``attach``) runs on the route's ``SequenceParallelContext``; every other
call goes to diffusers' function unchanged.

Layouts: diffusers passes ``[B, S_local, H, D]`` (rank i of the default group holds the i-th
contiguous chunk, as diffusers' ``EquipartitionSharder`` splits); the context takes and
returns ``[B, H, S_local, D]``. Calls the strategies do not implement (attention masks, query
and key/value lengths that differ, another head count, ``return_lse``, dropout) run the
backend on this rank's queries against the key/value tokens of every rank, all-gathered in
rank order (the all-gather diffusers' own ring attention does); the reason is logged once and
counted in ``ctx.stats()["fallbacks"]``. Every such decision depends only on shapes and flags
that are equal on every rank, so all ranks take the same path.
"""
from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from ...context import SequenceParallelContext
from ...log import get_logger, log_once

logger = get_logger(__name__)

ROUTE_ATTR = "_swiftfusion_route"     # on diffusers' ParallelConfig of a routed model
_WRAPPED_ATTR = "_swiftfusion_original"
# backend arguments the strategies take (values checked in ``fallback_reason``)
_KNOWN = {"query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa",
          "return_lse", "_parallel_config"}


class UnsupportedAttention(NotImplementedError):
    """An attention call that no context-parallel path computes exactly; the message says why."""


@dataclass
class Route:
    """One model's attention bound to ``ctx`` (the whole default process group)."""

    ctx: SequenceParallelContext
    world_size: int
    model_name: str

    def count_fallback(self, reason: str) -> None:
        log_once(logger, f"diffusers-fallback-{self.ctx.strategy}-{reason}",
                 f"{self.model_name}: an attention call has {reason}, which {self.ctx.strategy} "
                 "does not implement; it runs diffusers' attention on all-gathered keys/values "
                 "(counted in ctx.stats()['fallbacks'])")
        self.ctx.record_fallback(reason)


def fallback_reason(kwargs: dict[str, Any], num_heads: int) -> str | None:
    """Why this backend call cannot run on the strategy, or None (``kwargs`` as diffusers
    passes them; ``UnsupportedAttention`` for what no path computes exactly)."""
    q, k = kwargs["query"], kwargs["key"]
    if kwargs.get("is_causal"):
        raise UnsupportedAttention(
            "causal attention under context parallelism: the sequence is sharded, so a causal "
            "mask over local positions is wrong (diffusers' templated attention rejects it too)")
    if kwargs.get("return_lse"):
        return "return_lse=True"
    if kwargs.get("dropout_p"):
        return "dropout > 0"
    if kwargs.get("attn_mask") is not None:
        return "an attention mask"
    extra = sorted(n for n, v in kwargs.items() if n not in _KNOWN and v is not None)
    if extra:
        return f"backend arguments {extra}"
    if q.shape[1] != k.shape[1]:
        return "query and key/value lengths that differ (cross-attention)"
    if q.shape[2] != num_heads:
        return f"{q.shape[2]} heads (the context runs {num_heads})"
    if q.shape[2] % k.shape[2]:
        return f"{k.shape[2]} key/value heads for {q.shape[2]} query heads"
    return None


def _gather_seq(x: torch.Tensor, dim: int, world: int) -> torch.Tensor:
    """All-gather ``x`` over the default group and concatenate the chunks along ``dim`` in
    rank order (bool tensors travel as uint8)."""
    send = x.to(torch.uint8) if x.dtype == torch.bool else x
    send = send.contiguous()
    parts = [torch.empty_like(send) for _ in range(world)]
    dist.all_gather(parts, send)
    out = torch.cat(parts, dim=dim)
    return out.to(torch.bool) if x.dtype == torch.bool else out


def gathered_attention(original: Callable, kwargs: dict[str, Any], world: int) -> Any:
    """diffusers' ``original`` backend, unparallelised, on local queries ``[B, S_q, H, D]``
    against keys/values ``[B, S_kv, Hkv, D]`` gathered from every rank (concatenated in rank
    order). A mask whose last dimension is the local key length is gathered along it too."""
    k, v, mask = kwargs["key"], kwargs["value"], kwargs.get("attn_mask")
    local_kv = k.shape[1]
    call = dict(kwargs, key=_gather_seq(k, 1, world), value=_gather_seq(v, 1, world),
                _parallel_config=None)
    if mask is not None and mask.shape[-1] == local_kv:
        call["attn_mask"] = _gather_seq(mask, mask.dim() - 1, world)
    return original(**call)


@torch.compiler.disable(recursive=True, reason="sequence-parallel attention runs eagerly")
def routed_attention(route: Route, original: Callable, kwargs: dict[str, Any]) -> Any:
    """One backend call on ``route.ctx``: ``[B, S_local, H, D]`` in and out."""
    q, k, v = kwargs["query"], kwargs["key"], kwargs["value"]
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise UnsupportedAttention(
            f"{route.ctx.strategy} runs inference only (no backward through the strategies); "
            "run under torch.no_grad(), or train with diffusers' own context parallelism")
    reason = fallback_reason(kwargs, route.ctx.num_heads)
    if reason is not None:
        route.count_fallback(reason)
        return gathered_attention(original, kwargs, route.world_size)
    if k.shape[2] != q.shape[2]:  # grouped-query attention: query head h reads kv head h // rep
        rep = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    out = route.ctx.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                              scale=kwargs.get("scale"))
    return out.transpose(1, 2)


def _wrap(original: Callable) -> Callable:
    @functools.wraps(original)
    def backend(**kwargs: Any) -> Any:
        route = getattr(kwargs.get("_parallel_config"), ROUTE_ATTR, None)
        if route is None:
            return original(**kwargs)
        return routed_attention(route, original, kwargs)

    setattr(backend, _WRAPPED_ATTR, original)
    return backend


_install_lock = threading.Lock()
_users = 0


def install() -> None:
    """Wrap every registered backend that receives ``_parallel_config`` (counted: each
    ``install`` needs one ``uninstall``)."""
    global _users
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry as registry
    with _install_lock:
        for name, fn in list(registry._backends.items()):
            if hasattr(fn, _WRAPPED_ATTR):
                continue
            if "_parallel_config" in registry._supported_arg_names.get(name, ()):
                registry._backends[name] = _wrap(fn)
        _users += 1


def uninstall() -> None:
    """Undo one ``install``; the last one puts diffusers' own functions back."""
    global _users
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry as registry
    with _install_lock:
        _users = max(0, _users - 1)
        if _users:
            return
        for name, fn in list(registry._backends.items()):
            original = getattr(fn, _WRAPPED_ATTR, None)
            if original is not None:
                registry._backends[name] = original


def attach(parallel_config: Any, route: Route) -> None:
    """Route every attention call that receives ``parallel_config`` to ``route``."""
    setattr(parallel_config, ROUTE_ATTR, route)


def detach(parallel_config: Any) -> Route | None:
    """Stop routing ``parallel_config``'s calls; return the route it had."""
    route = getattr(parallel_config, ROUTE_ATTR, None)
    if route is not None:
        delattr(parallel_config, ROUTE_ATTR)
    return route


def route_of(parallel_config: Any) -> Route | None:
    return getattr(parallel_config, ROUTE_ATTR, None)


__all__ = ["ROUTE_ATTR", "Route", "UnsupportedAttention", "attach", "detach", "fallback_reason",
           "gathered_attention", "install", "route_of", "routed_attention", "uninstall"]
