"""The SGLang diffusion plugin (entry point ``sglang.multimodal_gen.plugins``: ``swiftfusion``).

SGLang calls ``register()`` in every worker before its GPU worker is imported
(``runtime/managers/worker_bootstrap.py``: ``load_plugins(); apply_plugin_hooks()``);
``register()`` only registers hooks through SGLang's ``plugin_hook``, SGLang applies them.
With no strategy configured (``$SWIFTFUSION_STRATEGY`` unset or ``usp``) it registers nothing:
SGLang runs exactly as without the plugin. ``SGLANG_PLUGINS`` (SGLang's filter) may exclude it.

``install()`` does the same in a running process (scripts, tests): it registers and applies the
hooks at once; ``uninstall()`` restores SGLang's ``forward``.
"""
from __future__ import annotations

from ...log import get_logger
from . import config, contexts, hooks

logger = get_logger(__name__)


def _registry():
    from sglang.multimodal_gen.runtime.platforms.plugins import HookRegistry, HookType
    return HookRegistry, HookType


def _register_hooks() -> None:
    from sglang.multimodal_gen.runtime.platforms.plugins import HookType, plugin_hook
    plugin_hook(hooks.TARGET, HookType.AROUND)(hooks.uspattention_forward)
    plugin_hook(hooks.PRE_EXCHANGE_TARGET, HookType.AROUND)(hooks.decline_pre_exchange)
    plugin_hook(hooks.SHUTDOWN_TARGET, HookType.BEFORE)(hooks.close_contexts)


def register() -> None:
    """The entry point's callable: hooks ``USPAttention.forward`` when a strategy is set."""
    cfg = config.current()  # an unknown $SWIFTFUSION_STRATEGY fails the plugin, loudly
    if cfg.strategy is None:
        logger.debug("SwiftFusion SGLang plugin: no strategy set; SGLang's USP runs")
        return
    _register_hooks()
    logger.info(f"SwiftFusion SGLang plugin: USPAttention on {cfg.strategy}")


def _ours(fn, hook=hooks.uspattention_forward) -> bool:
    """True when ``fn`` or a function it wraps is SGLang's wrapper around ``hook``."""
    while fn is not None:
        cells = getattr(fn, "__closure__", None) or ()
        if any(_cell(c) is hook for c in cells):
            return True
        fn = getattr(fn, "__wrapped__", None)
    return False


def _hook_target(registry, hook_type, target: str, hook) -> None:
    """Register ``hook`` (AROUND) on ``target`` unless the function there already runs it."""
    import pkgutil
    owner, _, name = target.rpartition(".")
    if _ours(getattr(pkgutil.resolve_name(owner), name), hook):
        return
    registry._hooks.pop(target, None)  # a stale record (the function was replaced since)
    registry._patched.discard(target)
    registry.register(target, hook, hook_type.AROUND)


def _cell(cell):
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def _uspattention():
    from sglang.multimodal_gen.runtime.layers.attention.layer import USPAttention
    return USPAttention


def installed() -> bool:
    """True when ``USPAttention.forward`` runs through our hook in this process."""
    return _ours(_uspattention().forward)


def install(strategy: str | None = None, comm: str = "auto", options: dict | None = None) -> None:
    """Hook SGLang's attention in this process now (idempotent); ``strategy`` as
    ``config.configure`` (None: from ``$SWIFTFUSION_STRATEGY``)."""
    if strategy is not None:
        config.configure(strategy, comm, options)
    if installed():
        return
    registry, hook_type = _registry()
    registry.register(hooks.TARGET, hooks.uspattention_forward, hook_type.AROUND)
    _hook_target(registry, hook_type, hooks.PRE_EXCHANGE_TARGET, hooks.decline_pre_exchange)
    if hooks.SHUTDOWN_TARGET not in registry._patched:
        registry.register(hooks.SHUTDOWN_TARGET, hooks.close_contexts, hook_type.BEFORE)
    registry.apply_hooks()
    if not installed():
        raise RuntimeError(f"SGLang did not apply the hook on {hooks.TARGET} (see its log)")


def uninstall() -> None:
    """Close our contexts, restore SGLang's ``USPAttention.forward`` and forget the strategy
    set by ``install`` (the hook on ``destroy_model_parallel`` stays: it only closes contexts)."""
    contexts.close_all()
    registry, _ = _registry()
    cls = _uspattention()
    fn = cls.__dict__["forward"]
    if _ours(fn):
        while fn is not None and not _ours_directly(fn):
            fn = getattr(fn, "__wrapped__", None)
        cls.forward = fn.__wrapped__
    registry._hooks.pop(hooks.TARGET, None)
    registry._patched.discard(hooks.TARGET)
    config.configure(None)
    # the pre-exchange hook stays, as the shutdown hook: without a strategy it calls through


def _ours_directly(fn) -> bool:
    return any(_cell(c) is hooks.uspattention_forward for c in (fn.__closure__ or ()))
