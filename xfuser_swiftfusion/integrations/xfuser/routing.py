"""xFuser's ``USP`` routed to a strategy: every xFuser model's attention runs on it.

    ctx = use_strategy("swiftfusion", num_heads=24)   # after torch.distributed is initialised
    ...                                                # every xFuser attention now runs on ctx
    restore_usp()                                      # xFuser's USP again; ctx closed

Every xFuser attention processor calls the module-level ``USP`` of the module it was defined
in, looked up at call time. Rebinding ``USP`` in ``xfuser.model_executor.layers.usp`` and in
every ``xfuser.*`` module that imported it by name (including modules imported later, through
a post-import hook) therefore moves every model, registry route included, onto the strategy;
no processor is replaced. ``routed_usp`` has USP's full signature ([B, H, S_local, D] in,
SP-rank order) and hands a call back to xFuser's USP when ``fallbacks.fallback_reason`` names
a feature the strategy does not implement.
"""
from __future__ import annotations

import contextvars
import sys
import threading
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.distributed as dist

from ...context import SequenceParallelContext, init_sequence_parallel
from ...groups import build_groups
from ...log import get_logger, log_once
from ...mesh import Mesh, choose_mesh
from ...strategies.registry import get as get_spec
from ...topology import Topology, TopologyError, detect_topology
from . import compat, state
from .fallbacks import fallback_reason
from .hooks import on_prefix_import
from .usp import SPEC as USP_SPEC

logger = get_logger(__name__)


class PluginError(ValueError):
    """A ``--sp-strategy`` setting that cannot run; the message names the constraint and fix."""


def check_strategy(strategy: str) -> None:
    """Raise ``PluginError`` unless ``strategy`` is a registered strategy."""
    try:
        get_spec(strategy)
    except ValueError as exc:
        raise PluginError(f"--sp-strategy: {exc}") from None


def plan_mesh(strategy: str, num_heads: int | None, topology: Topology,
              ulysses_degree: int | None = None, ring_degree: int | None = None) -> Mesh | None:
    """The mesh ``strategy`` will use, or ``PluginError`` naming the violated constraint.

    ``num_heads=None`` (head count unknown yet) checks the degrees against the topology only
    and returns None. ``usp`` honours given degrees as xFuser does (Ulysses x Ring = world).
    """
    W = topology.world_size
    given = ulysses_degree is not None or ring_degree is not None
    u = ulysses_degree if ulysses_degree is not None else (W // ring_degree if ring_degree else None)
    r = ring_degree if ring_degree is not None else (W // ulysses_degree if ulysses_degree else None)
    if given and (not u or not r or u * r != W):
        raise PluginError(f"--ulysses_degree {ulysses_degree} x --ring_degree {ring_degree} must "
                          f"equal the {W} ranks of topology {topology} (sequence parallelism over "
                          "the whole world); fix the degrees or --topology")
    if num_heads is None:
        return None
    try:
        return choose_mesh(topology, num_heads, get_spec(strategy).placement, u, r)
    except TopologyError as exc:
        raise PluginError(f"--sp-strategy {strategy} on topology {topology}: {exc}") from None


def read_num_heads(model: str, local_files_only: bool = False) -> int:
    """``num_attention_heads`` of ``model``'s transformer: a runner registry name (its
    checkpoint ``settings.model_name``), a local diffusers directory or a hub id (cache ok)."""
    name = model
    try:
        from xfuser.model_executor.models.runner_models.base_model import MODEL_REGISTRY
        import xfuser.model_executor.models.runner_models  # noqa: F401  (fills the registry)
        if model in MODEL_REGISTRY:
            name = MODEL_REGISTRY[model].settings.model_name
    except ImportError:
        pass
    try:
        from diffusers.configuration_utils import ConfigMixin

        class TransformerConfig(ConfigMixin):
            config_name = "config.json"

        config = TransformerConfig.load_config(name, subfolder="transformer",
                                               local_files_only=local_files_only)
        return int(config["num_attention_heads"])
    except Exception as exc:  # noqa: BLE001  (any load failure has the same remedy)
        raise PluginError(f"cannot read num_attention_heads of {name!r} from its "
                          f"transformer/config.json ({type(exc).__name__}: {exc}); the Ulysses "
                          "degree depends on it: make the checkpoint readable (local path or "
                          "hub cache)") from None


@dataclass
class _Route:
    ctx: SequenceParallelContext
    original: object          # xFuser's USP
    owns_state: bool          # we built xFuser's parallel state (restore tears it down)


_route: _Route | None = None
flux_text = contextvars.ContextVar("swiftfusion_flux_replicated_text", default=None)
_lock = threading.RLock()


def _usp_module() -> ModuleType:
    from xfuser.model_executor.layers import usp
    return usp


def rebind(old: object, new: object, name: str = "USP") -> None:
    """``module.<name> = new`` in every imported ``xfuser.*`` module whose ``<name>`` is ``old``."""
    for mod_name, mod in list(sys.modules.items()):
        if (mod_name == "xfuser" or mod_name.startswith("xfuser.")) and mod is not None \
                and mod.__dict__.get(name) is old:
            setattr(mod, name, new)


def _rebind_new_module(module: ModuleType) -> None:
    """Post-import hook for every ``xfuser.*`` module: route its ``USP`` while a strategy is on."""
    route = _route
    if route is not None and module.__dict__.get("USP") is route.original:
        module.USP = routed_usp


@torch.compiler.disable(recursive=True, reason="routed xFuser USP runs eagerly")
def routed_usp(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               dropout_p: float = 0.0, is_causal: bool = False,
               joint_query: torch.Tensor | None = None, joint_key: torch.Tensor | None = None,
               joint_value: torch.Tensor | None = None, joint_strategy: str | None = None,
               attn_layer=None, combine_qkv_a2a: bool | None = None, backend=None,
               attention_kwargs: dict | None = None, head_balance_layer=None,
               kv_head_repeat: int = 1) -> torch.Tensor:
    """xFuser's ``USP`` signature, run on the routed strategy ([B, H, S_local, D] in and out;
    with joint tensors ``[B, H, Tj + S_local, D]``, text rows ``front``/``rear``)."""
    route = _route
    if route is None:  # restored while a caller still held this function
        return _usp_module().USP(query, key, value, dropout_p, is_causal, joint_query, joint_key,
                                 joint_value, joint_strategy, attn_layer, combine_qkv_a2a,
                                 backend, attention_kwargs, head_balance_layer, kv_head_repeat)
    text = flux_text.get()
    if text is not None and joint_strategy is None and query.shape[2] > text:
        # Flux with replicated text rows in front: attend to them once, as joint tokens.
        # [B, H, T + S_local, D] -> text [B, H, T, D] + image [B, H, S_local, D]
        joint_query, query = query[:, :, :text], query[:, :, text:]
        joint_key, key = key[:, :, :text], key[:, :, text:]
        joint_value, value = value[:, :, :text], value[:, :, text:]
        joint_strategy = "front"
    ctx = route.ctx
    reason = fallback_reason(query, key, dropout_p, is_causal, attn_layer, backend,
                             attention_kwargs, head_balance_layer, kv_head_repeat,
                             joint_strategy, ctx.num_heads)
    runs_usp = ctx._impl.spec is USP_SPEC  # xFuser's own USP gets every argument as given
    if runs_usp or reason is not None:
        if reason is not None:
            log_once(logger, f"fallback-{ctx.strategy}-{reason}",
                     f"{ctx.strategy}: this attention call uses {reason}, which the strategy does "
                     "not implement; running xFuser's own USP for such calls (counted in "
                     "ctx.stats()['fallbacks'])")
            ctx.record_fallback(reason)
        else:
            ctx.calls += 1
        return route.original(query, key, value, dropout_p, is_causal, joint_query, joint_key,
                              joint_value, joint_strategy, attn_layer, combine_qkv_a2a, backend,
                              attention_kwargs, head_balance_layer, kv_head_repeat)
    return ctx.attention(query, key, value, joint_query=joint_query, joint_key=joint_key,
                         joint_value=joint_value, joint_strategy=joint_strategy)


def _ensure_xfuser_state(strategy: str, mesh: Mesh) -> bool:
    """Build xFuser's groups for ``mesh`` (True) or check the existing ones agree (False)."""
    groups = build_groups(mesh)
    if not state.xfuser_parallel_initialized():
        state.init_xfuser_parallel(mesh.ulysses, mesh.ring, mesh.placement, groups)
        return True
    u, r, sp_ranks = state.xfuser_sp_layout()
    world = dist.get_world_size()
    if sp_ranks != list(range(world)):
        raise PluginError(f"--sp-strategy {strategy} needs one sequence-parallel group over all "
                          f"{world} ranks, but xFuser's SP group is {sp_ranks} (data, CFG, "
                          "PipeFusion or tensor parallelism is on); set those degrees to 1")
    if (u, r) != (mesh.ulysses, mesh.ring):
        raise PluginError(f"xFuser was initialised with Ulysses {u} x Ring {r}, but "
                          f"{strategy} uses {mesh.describe()}; pass --ulysses_degree "
                          f"{mesh.ulysses} --ring_degree {mesh.ring} or let --sp-strategy choose")
    try:
        state.check_group_agreement(groups)
    except AssertionError as exc:
        raise PluginError(f"xFuser's groups do not have the {mesh.placement!r} placement that "
                          f"{strategy} needs ({exc}); initialise xFuser through use_strategy or "
                          "--sp-strategy") from None
    return False


def use_strategy(strategy: str, num_heads: int, topology: str | None = None, *,
                 ulysses_degree: int | None = None, ring_degree: int | None = None,
                 timeout_s: float | None = None) -> SequenceParallelContext:
    """Route xFuser's ``USP`` (every model) to ``strategy``; return its context.

    Call after ``torch.distributed`` is initialised. Builds xFuser's parallel state with the
    strategy's placement and degrees when it does not exist yet, otherwise checks that it
    agrees (``PluginError`` naming the mismatch). ``topology``: ``"NxM"`` override (else
    ``$SWIFTFUSION_TOPOLOGY`` / detection). One strategy at a time: ``restore_usp()`` first
    to switch.
    """
    global _route
    check_strategy(strategy)
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("use_strategy needs torch.distributed initialised (torchrun + "
                           "dist.init_process_group, or xFuserArgs.create_config())")
    compat.apply()
    with _lock:
        if _route is not None:
            raise RuntimeError(f"strategy {_route.ctx.strategy!r} is already routed; call "
                               "restore_usp() before use_strategy() again")
        topo = detect_topology(dist.get_world_size(), topology)
        mesh = plan_mesh(strategy, num_heads, topo, ulysses_degree, ring_degree)
        on_prefix_import("xfuser.", _rebind_new_module)
        usp = _usp_module()
        owns = _ensure_xfuser_state(strategy, mesh)
        try:  # xFuser's groups exist now: a usp context runs on them (and leaves them alone)
            ctx = init_sequence_parallel(
                strategy, num_heads, topo, ulysses_degree=mesh.ulysses, ring_degree=mesh.ring,
                timeout_s=timeout_s, options={"xfuser_usp": usp.USP, "usp_ulysses": mesh.ulysses})
        except BaseException:
            if owns:
                state.destroy_xfuser_parallel()
            raise
        _route = _Route(ctx, usp.USP, owns)
        state.hold_original_usp(usp.USP)
        rebind(usp.USP, routed_usp)
    logger.info(f"rank {ctx.rank}: xFuser USP routed to {ctx.strategy} ({mesh.describe()}, "
                f"topology {topo})")
    return ctx


def restore_usp() -> None:
    """Undo ``use_strategy``: xFuser's own ``USP`` everywhere, the context closed, and
    xFuser's parallel state torn down if ``use_strategy`` built it. Idempotent."""
    global _route
    with _lock:
        route, _route = _route, None
        if route is None:
            return
        rebind(routed_usp, route.original)
        state.hold_original_usp(None)
    stats = route.ctx.stats()
    logger.info(f"rank {route.ctx.rank}: {stats['strategy']} ({stats['mesh']}): "
                f"{stats['calls']} attention calls, fallbacks {stats['fallbacks']}, "
                f"inter-node bytes {stats['inter_node_bytes']}")
    route.ctx.close()
    if route.owns_state:
        state.destroy_xfuser_parallel()


def routed_context() -> SequenceParallelContext | None:
    """The context xFuser's USP is routed to, or None."""
    route = _route
    return route.ctx if route is not None else None


def hand_state_to_xfuser() -> None:
    """xFuser tears its own groups down next: restore USP without destroying them."""
    route = _route
    if route is not None:
        route.owns_state = False
        restore_usp()


__all__ = ["PluginError", "check_strategy", "plan_mesh", "read_num_heads", "use_strategy",
           "restore_usp", "routed_context", "routed_usp", "rebind", "flux_text", "hand_state_to_xfuser"]
