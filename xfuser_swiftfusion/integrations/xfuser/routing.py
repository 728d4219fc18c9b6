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
from ...topology import Topology, TopologyError, detect_topology, subset_topology
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
    fp8_comms: bool = False   # the strategy sends inter-machine transfers as FP8


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


# xFuser modules whose attention processors keep the ``USP`` of their construction time
# (``self.attention_function = USP`` / ``self.attention_method = USP``): a model built before
# ``use_strategy`` would run xFuser's USP on every call, unseen by the strategy
BINDS_USP_AT_INIT = (
    "xfuser.model_executor.models.transformers.transformer_wan",
    "xfuser.model_executor.models.transformers.transformer_ideogram4",
    "xfuser.model_executor.models.transformers.transformer_ltx2",
)


def usp_at_call_time(*args, **kwargs) -> torch.Tensor:
    """xFuser's ``USP`` as bound when called: the routed strategy's, or xFuser's own."""
    return _usp_module().USP(*args, **kwargs)


def bind_usp_at_call_time(module: ModuleType) -> None:
    """Post-import hook for ``BINDS_USP_AT_INIT``: the module's ``USP`` global becomes
    ``usp_at_call_time``, so processors that store it at construction still follow routing."""
    if getattr(module, "USP", None) is not usp_at_call_time:
        module.USP = usp_at_call_time


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
                             joint_strategy, ctx.num_heads, ctx.mesh.world_size,
                             fp8_comms=route.fp8_comms)
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
    fp8_layer = _fp8_calibrated_layer(route, attn_layer, head_balance_layer, joint_strategy)
    if fp8_layer is not None:  # xFuser's calibration pass measures what its USP would (its
        # scales stay unused: the strategy scales each slot itself); else its sync raises
        from xfuser.core.distributed import get_runtime_state
        from xfuser.core.distributed.fp8_comms import fp8_attention_kwargs
        xstate = get_runtime_state()
        fp8_state = xstate.fp8_comms
        fp8_attention_kwargs(fp8_state, fp8_layer, query, key, value, False,
                             backend if backend is not None else xstate.attention_backend)
    # grouped-query K/V keep their heads; a key mask (Krea-2) is applied by the strategy
    out = ctx.attention(query, key, value, joint_query=joint_query, joint_key=joint_key,
                        joint_value=joint_value, joint_strategy=joint_strategy,
                        key_mask=(attention_kwargs or {}).get("attn_mask"))
    if fp8_layer is not None:
        from xfuser.core.distributed.fp8_comms import fp8_observe_output
        fp8_observe_output(fp8_state, fp8_layer, out, False)
    return out


def _fp8_calibrated_layer(route: _Route, attn_layer, head_balance_layer, joint_strategy):
    """The attention layer xFuser's FP8 calibration observes in this call, or None."""
    if not route.fp8_comms or joint_strategy is not None:
        return None
    from xfuser.core.distributed import get_runtime_state
    layer = attn_layer if attn_layer is not None else head_balance_layer
    if layer is None or getattr(get_runtime_state(), "fp8_comms", None) is None:
        return None
    return layer


def _ensure_xfuser_state(strategy: str, mesh: Mesh,
                         sp_groups: list[tuple[int, ...]] | None = None) -> bool:
    """Build xFuser's groups for ``mesh`` on this rank's SP group of ``sp_groups`` (default:
    the whole world) (True) or check the existing ones agree (False)."""
    world = dist.get_world_size()
    sp_groups = sp_groups or [tuple(range(world))]
    members = next(g for g in sp_groups if dist.get_rank() in g)
    groups = build_groups(mesh, members=members, sp_groups=sp_groups)
    if not state.xfuser_parallel_initialized():
        state.init_xfuser_parallel(mesh.ulysses, mesh.ring, mesh.placement, groups)
        return True
    u, r, sp_ranks = state.xfuser_sp_layout()
    cfg = state.xfuser_cfg_degree()
    if sp_ranks != sorted(members) or cfg != len(sp_groups):
        raise PluginError(
            f"--sp-strategy {strategy} runs on SP group {list(members)} of "
            f"{len(sp_groups)} (CFG degree {len(sp_groups)}), but xFuser's SP group is "
            f"{sp_ranks} with CFG degree {cfg} (data, PipeFusion or tensor parallelism, or a "
            "different --use_cfg_parallel); set those degrees to 1 and pass the same "
            "--use_cfg_parallel")
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


def cfg_sp_topology(strategy: str, world_topology: Topology,
                    cfg_degree: int) -> tuple[list[tuple[int, ...]], Topology]:
    """xFuser's SP groups for CFG degree ``cfg_degree`` on ``world_topology`` and the machines
    x GPUs of each (the same for all), or ``PluginError`` naming the constraint."""
    W = world_topology.world_size
    if cfg_degree not in (1, 2) or W % cfg_degree:
        raise PluginError(f"--sp-strategy {strategy}: CFG degree {cfg_degree} on {W} ranks; "
                          "--use_cfg_parallel splits an even number of ranks in two")
    groups = state.cfg_sp_groups(W, cfg_degree)
    try:
        tops = {subset_topology(world_topology, g) for g in groups}
    except TopologyError as exc:
        raise PluginError(f"--sp-strategy {strategy} with --use_cfg_parallel on topology "
                          f"{world_topology}: each CFG half is one SP group of {W // cfg_degree} "
                          f"ranks, and {exc}") from None
    if len(tops) != 1:
        raise PluginError(f"--sp-strategy {strategy} with --use_cfg_parallel on topology "
                          f"{world_topology}: the CFG halves span machines differently "
                          f"({', '.join(map(str, tops))})")
    return groups, tops.pop()


def check_sp_degrees(strategy: str, sp_topology: Topology, cfg_degree: int,
                     ulysses_degree: int | None, ring_degree: int | None) -> None:
    """``PluginError`` unless given degrees multiply to the SP group of a CFG split."""
    if cfg_degree == 1 or (ulysses_degree is None and ring_degree is None):
        return  # plan_mesh checks the degrees of one SP group over the whole world
    W = sp_topology.world_size
    u, r = ulysses_degree or W // (ring_degree or W), ring_degree or W // (ulysses_degree or W)
    if u * r != W:
        given = ", ".join(f"--{n} {d}" for n, d in (("ulysses_degree", ulysses_degree),
                                                     ("ring_degree", ring_degree)) if d)
        raise PluginError(f"Ulysses x Ring degree ({given}) must "
                          f"equal the {W} ranks of each SP group (with --use_cfg_parallel the "
                          f"{W * cfg_degree} ranks form {cfg_degree} SP groups, {sp_topology} "
                          "each); fix the degrees or --topology")


def use_strategy(strategy: str, num_heads: int, topology: str | None = None, *,
                 ulysses_degree: int | None = None, ring_degree: int | None = None,
                 timeout_s: float | None = None, cfg_degree: int = 1,
                 fp8_comms: bool = False, options: dict | None = None) -> SequenceParallelContext:
    """Route xFuser's ``USP`` (every model) to ``strategy``; return its context.

    Call after ``torch.distributed`` is initialised. Builds xFuser's parallel state with the
    strategy's placement and degrees when it does not exist yet, otherwise checks that it
    agrees (``PluginError`` naming the mismatch). ``topology``: ``"NxM"`` override of the whole
    world (else ``$SWIFTFUSION_TOPOLOGY`` / detection). ``cfg_degree=2`` (xFuser's
    ``--use_cfg_parallel``): the strategy runs on each CFG half, xFuser's SP group (ranks
    ``[0, W/2)`` and ``[W/2, W)``), with that half's machines as its topology (the context's
    ``topology``, ``mesh`` and ``rank`` are its SP group's). One strategy at a time:
    ``restore_usp()`` first to switch. ``fp8_comms`` (xFuser's ``--use_fp8_comms``): the
    strategy sends what crosses machines as FP8 with per-slot scales (option ``fp8_comms``).
    ``options``: more options of ``init_sequence_parallel`` (``cuda_graphs``, ``launches``).
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
        sp_groups, sp_topo = cfg_sp_topology(strategy, topo, cfg_degree)
        check_sp_degrees(strategy, sp_topo, cfg_degree, ulysses_degree, ring_degree)
        mesh = plan_mesh(strategy, num_heads, sp_topo, ulysses_degree, ring_degree)
        members = next(g for g in sp_groups if dist.get_rank() in g)
        on_prefix_import("xfuser.", _rebind_new_module)
        usp = _usp_module()
        owns = _ensure_xfuser_state(strategy, mesh, sp_groups)
        try:  # xFuser's groups exist now: a usp context runs on them (and leaves them alone)
            ctx = init_sequence_parallel(
                strategy, num_heads, topo, ulysses_degree=ulysses_degree, ring_degree=ring_degree,
                timeout_s=timeout_s, options={**(options or {}), "xfuser_usp": usp.USP,
                                              "usp_ulysses": mesh.ulysses, "fp8_comms": bool(fp8_comms)},
                ranks=list(members))
        except BaseException:
            if owns:
                state.destroy_xfuser_parallel()
            raise
        _route = _Route(ctx, usp.USP, owns, bool(fp8_comms))
        state.hold_original_usp(usp.USP)
        rebind(usp.USP, routed_usp)
    cfg = "" if cfg_degree == 1 else f", CFG half {list(members)} on {sp_topo}"
    fp8 = ", FP8 across machines" if fp8_comms else ""
    logger.info(f"rank {dist.get_rank()}: xFuser USP routed to {ctx.strategy} "
                f"({mesh.describe()}, topology {topo}{cfg}{fp8})")
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
