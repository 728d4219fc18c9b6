"""xFuser integration: ``--sp-strategy`` in xFuser's own CLI, and ``USP()`` routed to a strategy.

    from xfuser_swiftfusion.integrations import xfuser as sfx
    ctx = sfx.use_strategy("swiftfusion", num_heads=24)  # after torch.distributed is initialised
    ...                                                   # every xFuser attention runs on ctx
    sfx.restore_usp()                                     # xFuser's USP again; ctx closed

Modules (importing this package imports none of xFuser, and changes nothing):
- ``usp``: xFuser's own USP as the registry's ``usp`` strategy (entry point);
- ``routing``: ``USP()`` routed to a strategy (``use_strategy``/``restore_usp``), mesh planning;
- ``fallbacks``: which calls go back to xFuser's USP, and why;
- ``args``: ``--sp-strategy``/``--topology`` in ``xFuserArgs`` and ``xdit``;
- ``runner``: the FLUX.1 / FLUX.2 / Qwen-Image wrapper fixes and teardown while a strategy is routed;
- ``state``: xFuser's parallel state on our groups (``groups.SPGroups``);
- ``compat``: xFuser 0.7.0 on a host without CUDA (applied by ``install``; no-op with CUDA);
- ``hooks``: post-import hooks (wrapt's, plus one for module-name prefixes).

``install()`` registers the hooks; the ``.pth`` autoloader calls it when a process imports
xFuser, ``use_strategy`` calls it too.
"""
from __future__ import annotations

import threading

from ...context import SequenceParallelContext
from . import compat
from .args import patch_args, patch_xdit, route_sp_strategy, xdit_nproc
from .hooks import on_import
from .routing import (BINDS_USP_AT_INIT, PluginError, bind_usp_at_call_time, check_strategy,
                      plan_mesh, read_num_heads, restore_usp, routed_context, routed_usp)
from .routing import use_strategy as _use_strategy
from .runner import (FLUX2_MODULE, QWEN_MODULE, patch_flux2_wrapper, patch_flux_wrapper,
                     patch_qwen_wrapper, patch_runtime_teardown)

_installed = False
_lock = threading.Lock()


def install() -> None:
    """Register the xFuser hooks (idempotent; cheap until xFuser modules load): CPU
    compatibility on hosts without CUDA, ``--sp-strategy`` in ``xFuserArgs`` and ``xdit``, the
    runner fixes and teardown."""
    global _installed
    with _lock:
        if _installed:
            return
        compat.apply()
        on_import("xfuser.config.args", patch_args)
        on_import("xfuser.cli", patch_xdit)
        on_import("xfuser.core.distributed.runtime_state", patch_runtime_teardown)
        on_import("xfuser.model_executor.models.transformers.transformer_flux", patch_flux_wrapper)
        on_import(FLUX2_MODULE, patch_flux2_wrapper)
        on_import(QWEN_MODULE, patch_qwen_wrapper)
        for name in BINDS_USP_AT_INIT:
            on_import(name, bind_usp_at_call_time)
        _installed = True


def use_strategy(strategy: str, num_heads: int, topology: str | None = None, *,
                 ulysses_degree: int | None = None, ring_degree: int | None = None,
                 timeout_s: float | None = None, cfg_degree: int = 1,
                 fp8_comms: bool = False) -> SequenceParallelContext:
    """``install()``, then route xFuser's ``USP`` (every model) to ``strategy`` and return its
    context (``routing.use_strategy``; ``cfg_degree=2``: one SP group per CFG half;
    ``fp8_comms``: what crosses machines travels as float8 with scales)."""
    install()
    return _use_strategy(strategy, num_heads, topology, ulysses_degree=ulysses_degree,
                         ring_degree=ring_degree, timeout_s=timeout_s, cfg_degree=cfg_degree,
                         fp8_comms=fp8_comms)

__all__ = ["PluginError", "check_strategy", "install", "plan_mesh", "read_num_heads",
           "restore_usp", "route_sp_strategy", "routed_context", "routed_usp", "use_strategy",
           "xdit_nproc"]
