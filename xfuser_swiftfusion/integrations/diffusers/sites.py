"""Attention modules whose queries or keys/values are the same on every rank.

A model's ``_cp_plan`` splits some inputs; tokens derived from an input it does not split
(LTX-2's audio and the audio prompt, MiniMax-H3's text before its refiner hands it to the
blocks) stay whole on every rank. diffusers still passes the context-parallel config to
their attention, whose shapes alone do not say what is sharded. ``plans.REPLICATED`` names
these modules per model class; ``install`` marks each one's forward, and ``current()``
tells the routed backend, during the call, what its tokens are:

- keys/values on every rank (``kv_sharded=False``): the attention is local, as diffusers
  runs it on one device; nothing is exchanged;
- queries on every rank, keys/values sharded (``query_sharded=False``): each rank attends
  its own keys and the query-sized partial results are merged (``routing.merged_attention``);
- every other call of a routed model has sharded queries and keys/values.
"""
from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Site:
    """What one attention module's tokens are under the plan."""

    query_sharded: bool
    kv_sharded: bool

    def describe(self) -> str:
        part = lambda sharded: "sharded" if sharded else "on every rank"  # noqa: E731
        return f"queries {part(self.query_sharded)}, keys/values {part(self.kv_sharded)}"


_current: contextvars.ContextVar[Site | None] = contextvars.ContextVar(
    "swiftfusion_diffusers_site", default=None)


def current() -> Site | None:
    """The ``Site`` of the attention module running now, or None (sharded queries and keys)."""
    return _current.get()


def install(modules: dict[torch.nn.Module, Site]) -> list[Any]:
    """Mark each module's forward with its ``Site``; returns the hook handles (``remove``)."""
    handles = []
    for module, site in modules.items():
        tokens: list[contextvars.Token] = []

        @torch.compiler.disable(reason="marks the attention call's site (a context variable)")
        def enter(_module, _args, site=site, tokens=tokens) -> None:
            tokens.append(_current.set(site))

        @torch.compiler.disable(reason="marks the attention call's site (a context variable)")
        def leave(_module, _args, _out, tokens=tokens) -> None:
            _current.reset(tokens.pop())

        handles.append(module.register_forward_pre_hook(enter))
        handles.append(module.register_forward_hook(leave, always_call=True))
    return handles


def remove(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()


__all__ = ["Site", "current", "install", "remove"]
