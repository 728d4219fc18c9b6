"""diffusers' attention backends routed to a SwiftFusion context while context parallelism is on.

Every diffusers attention processor calls ``dispatch_attention_fn``, which looks the backend
function up in ``_AttentionBackendRegistry._backends`` at call time and passes it keyword
arguments only, ``_parallel_config`` among them for the backends that support context
parallelism. ``install`` wraps each such function once: a call whose ``_parallel_config``
carries a ``Route`` (``attach``) runs on the route's context (``routed_attention``); every
other call goes to diffusers' function unchanged.

Layouts: diffusers passes ``[B, S_local, H, D]`` (rank i of the default group holds the i-th
contiguous chunk, as diffusers' ``EquipartitionSharder`` splits); the context takes and
returns ``[B, H, S_local, D]``. Each routed call takes one path (``PATHS``, counted per route):

- ``strategy``: sharded queries and keys/values of one length: ``ctx.attention``, grouped-
  query K/V with their own heads, a key-padding mask in any form diffusers passes
  (``masks``) as ``key_mask=`` over the whole sequence (``key-masked`` counts those; an
  all-ones mask runs unmasked);
- ``local``: keys/values on every rank (``sites``): diffusers' backend on this rank's tokens,
  as on one device; nothing is exchanged;
- ``merged``: queries on every rank, keys/values sharded: each rank attends its own keys
  and the query-sized partial results (output and log-sum-exp) are all-gathered and merged
  in rank order, so every rank holds the same output;
- ``gathered``: everything else (a mask that depends on the query or is a bias, query and
  key/value lengths that differ, another head count, ``return_lse``, dropout): diffusers'
  backend on this rank's queries against the key/value tokens of every rank, all-gathered in
  rank order (the all-gather diffusers' own ring attention does); the reason is logged once
  and counted in ``ctx.stats()["fallbacks"]``. For LTX's and LTX-2's video -> text
  cross-attention (``CROSS_ATTENTION``) this is the right exchange: the plan shards the
  text with the video, every video query needs every text key, and the text is short.

Every decision depends on shapes and flags equal on every rank, or on values all ranks
exchange first (``masks.agreed_key_mask``), so all ranks take the same path.
"""
from __future__ import annotations

import functools
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from ...context import SequenceParallelContext
from ...kernels import attend, merge_states, new_state
from ...kernels.state import AttnState, finalize
from ...log import get_logger, log_once
from . import masks, sites

logger = get_logger(__name__)

ROUTE_ATTR = "_swiftfusion_route"     # on diffusers' ParallelConfig of a routed model
_WRAPPED_ATTR = "_swiftfusion_original"
# backend arguments the strategies take (values checked in ``fallback_reason``)
_KNOWN = {"query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa",
          "return_lse", "_parallel_config"}
PATHS = ("strategy", "key-masked", "local", "merged", "gathered")
CROSS_ATTENTION = ("query and key/value lengths that differ (cross-attention over sharded "
                   "keys/values: they are all-gathered)")


class UnsupportedAttention(NotImplementedError):
    """An attention call that no context-parallel path computes exactly; the message says why."""


@dataclass
class Route:
    """One model's attention bound to ``ctx`` (the whole default process group)."""

    ctx: SequenceParallelContext
    world_size: int
    model_name: str
    paths: Counter = field(default_factory=Counter)  # PATHS -> calls since enable

    def count_fallback(self, reason: str) -> None:
        if self.ctx.rank == 0:
            log_once(logger, f"diffusers-fallback-{self.ctx.strategy}-{reason}",
                     f"{self.model_name}: an attention call has {reason}, which "
                     f"{self.ctx.strategy} does not implement; it runs diffusers' attention on "
                     "all-gathered keys/values (counted in ctx.stats()['fallbacks'])")
        self.ctx.record_fallback(reason)
        self.paths["gathered"] += 1


def fallback_reason(kwargs: dict[str, Any], num_heads: int) -> str | None:
    """Why this backend call of sharded queries and keys/values cannot run on the strategy,
    or None; shapes and flags only (a mask's values are judged by ``masks``).
    ``UnsupportedAttention`` for what no path computes exactly."""
    q, k = kwargs["query"], kwargs["key"]
    if kwargs.get("is_causal"):
        raise UnsupportedAttention(
            "causal attention under context parallelism: the sequence is sharded, so a causal "
            "mask over local positions is wrong (diffusers' templated attention rejects it too)")
    if reason := _flag_reason(kwargs):
        return reason
    if q.shape[1] != k.shape[1]:
        return CROSS_ATTENTION
    if q.shape[2] != num_heads:
        return f"{q.shape[2]} heads (the context runs {num_heads})"
    return None


def _flag_reason(kwargs: dict[str, Any]) -> str | None:
    """Arguments no path but diffusers' own backend takes, or grouped-query heads that do
    not divide the query heads."""
    q, k = kwargs["query"], kwargs["key"]
    if kwargs.get("return_lse"):
        return "return_lse=True"
    if kwargs.get("dropout_p"):
        return "dropout > 0"
    extra = sorted(n for n, v in kwargs.items() if n not in _KNOWN and v is not None)
    if extra:
        return f"backend arguments {extra}"
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


def gathered_attention(original: Callable, kwargs: dict[str, Any], world: int,
                       local: masks.LocalMask | None = None) -> Any:
    """diffusers' ``original`` backend, unparallelised, on local queries ``[B, S_q, H, D]``
    against keys/values ``[B, S_kv, Hkv, D]`` gathered from every rank (concatenated in rank
    order). ``local``: the call's mask cut to this rank's queries; one over local keys is
    gathered along them too."""
    k, v = kwargs["key"], kwargs["value"]
    call = dict(kwargs, key=_gather_seq(k, 1, world), value=_gather_seq(v, 1, world),
                _parallel_config=None)
    if local is not None:
        call["attn_mask"] = local.m if local.whole else _gather_seq(local.m, 3, world)
    return original(**call)


def _localize(route: Route, kwargs: dict[str, Any]) -> masks.LocalMask | None:
    """The call's mask as a ``masks.LocalMask`` (None: no mask); ``UnsupportedAttention``
    for a mask whose shape fits neither this rank's keys nor every rank's."""
    mask = kwargs.get("attn_mask")
    if mask is None:
        return None
    (B, S_q, H, _), S_kv = kwargs["query"].shape, kwargs["key"].shape[1]
    try:
        return masks.localize(mask, B, H, S_q, S_kv, route.world_size, route.ctx.rank)
    except masks.MaskShapeError as exc:
        raise UnsupportedAttention(
            f"{route.model_name}: {exc}: the model's _cp_plan does not shard this mask with "
            "its tokens, so no rank can apply it to its own (diffusers' own context "
            "parallelism cannot either); shard it in the plan (cp_plan=)") from None


def _key_mask(route: Route, kwargs: dict[str, Any], reason: str | None
              ) -> tuple[masks.LocalMask | None, torch.Tensor | None, str | None]:
    """(the call's mask cut to this rank's queries or None, its whole-sequence key mask
    ``[B, W * S_kv]`` or None, ``reason`` or why the mask is no key mask); the key mask is
    agreed on (``masks.agreed_key_mask``) only where ``reason`` is None."""
    local = _localize(route, kwargs)
    if local is None or reason is not None:
        return local, None, reason
    q, k = kwargs["query"], kwargs["key"]
    return (local, *masks.agreed_key_mask(local, q.shape[0], k.shape[1], route.world_size))


def _fall_back(route: Route, original: Callable, kwargs: dict[str, Any], reason: str,
               local: masks.LocalMask | None) -> Any:
    route.count_fallback(reason)
    return gathered_attention(original, kwargs, route.world_size, local)


def merged_attention(route: Route, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     key_mask: torch.Tensor | None, scale: float | None) -> torch.Tensor:
    """Queries ``q`` ``[B, S_q, H, D]`` on every rank against keys/values ``[B, S_kv, Hkv, D]``
    sharded in rank order (``key_mask``: this rank's ``[B, S_kv]`` or None): each rank
    attends its keys, the fp32 states (``[B, H, S_q, D]`` accumulator, ``[B, H, S_q]``
    running max and sum) are all-gathered and merged in rank order: the same output on
    every rank, ``[B, S_q, H, D]``."""
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))  # [B, S, H, D] -> [B, H, S, D]
    state = new_state(qh)
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    attend([qh], [(kh, vh)], [state], scale=scale,
           key_masks=None if key_mask is None else [key_mask])
    sizes = [state.acc.numel(), state.m.numel(), state.l.numel()]
    mine = torch.cat([state.acc.reshape(-1), state.m.reshape(-1), state.l.reshape(-1)])
    parts = [torch.empty_like(mine) for _ in range(route.world_size)]
    dist.all_gather(parts, mine)
    merged = None
    for part in parts:  # rank order: bit-identical on every rank
        acc, m, l = part.split(sizes)
        s = AttnState(acc.view_as(state.acc), m.view_as(state.m), l.view_as(state.l))
        merged = s if merged is None else merge_states(merged, s)
    return finalize(merged, q.dtype).transpose(1, 2)  # [B, H, S_q, D] -> [B, S_q, H, D]


@torch.compiler.disable(recursive=True, reason="sequence-parallel attention runs eagerly")
def routed_attention(route: Route, original: Callable, kwargs: dict[str, Any]) -> Any:
    """One backend call on ``route.ctx``: ``[B, S_local, H, D]`` in and out."""
    q, k, v = kwargs["query"], kwargs["key"], kwargs["value"]
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise UnsupportedAttention(
            f"{route.ctx.strategy} runs inference only (no backward through the strategies); "
            "run under torch.no_grad(), or train with diffusers' own context parallelism")
    site = sites.current()
    if site is not None and not site.kv_sharded:
        if kwargs.get("is_causal") and site.query_sharded:
            fallback_reason(kwargs, route.ctx.num_heads)  # raises: causal over sharded queries
        route.paths["local"] += 1
        return original(**dict(kwargs, _parallel_config=None))
    if site is not None and not site.query_sharded:
        return _replicated_queries(route, original, kwargs)
    local, key_mask, reason = _key_mask(route, kwargs, fallback_reason(kwargs, route.ctx.num_heads))
    if reason is not None:
        return _fall_back(route, original, kwargs, reason, local)
    route.paths["strategy"] += 1
    route.paths["key-masked"] += key_mask is not None
    # grouped-query K/V keep their heads; the key mask is the one the xFuser path passes
    out = route.ctx.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                              scale=kwargs.get("scale"), key_mask=key_mask)
    return out.transpose(1, 2)


def _replicated_queries(route: Route, original: Callable, kwargs: dict[str, Any]) -> Any:
    """A call whose queries are on every rank and keys/values sharded: ``merged_attention``,
    or the gathered path where that cannot run it."""
    if kwargs.get("is_causal"):
        fallback_reason(kwargs, route.ctx.num_heads)  # raises
    local, key_mask, reason = _key_mask(route, kwargs, _flag_reason(kwargs))
    if reason is not None:
        return _fall_back(route, original, kwargs, reason, local)
    route.paths["merged"] += 1
    S_kv = kwargs["key"].shape[1]
    return merged_attention(route, kwargs["query"], kwargs["key"], kwargs["value"],
                            masks.local_columns(key_mask, route.ctx.rank, S_kv), kwargs.get("scale"))


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


__all__ = ["CROSS_ATTENTION", "PATHS", "ROUTE_ATTR", "Route", "UnsupportedAttention", "attach",
           "detach", "fallback_reason", "gathered_attention", "install", "merged_attention",
           "route_of", "routed_attention", "uninstall"]
