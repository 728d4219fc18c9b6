"""xFuser integration: ``--sp-strategy`` in xFuser's own CLI, and USP routed to a strategy.

Two public functions (used by the runner hook, the examples and ``swiftfusion compare``):

    ctx = use_strategy("swiftfusion", num_heads=24)   # after torch.distributed is initialised
    ...                                                # every xFuser attention now runs on ctx
    restore_usp()                                      # xFuser's USP again; ctx closed

Routing. Every xFuser attention processor (Flux: ``xFuserFluxAttnProcessor``; CogVideoX:
``xFuserCogVideoXAttnProcessor2_0`` in the example scripts and ``xFuserConsisIDAttnProcessor2_0``,
which wins the ``xFuserAttentionProcessorRegister`` key ``CogVideoXAttnProcessor2_0`` for the
legacy wrappers) calls the module-level ``USP`` of the module it was defined in, looked up at
call time. Rebinding ``USP`` in ``xfuser.model_executor.layers.usp`` and in every ``xfuser.*``
module that imported it by name (including modules imported later, through a post-import hook)
therefore moves every model, registry route included, onto the strategy; no processor is
replaced. The replacement has USP's full signature ([B, H, S_local, D] in, SP-rank order) and
hands a call back to xFuser's USP, with a one-time warning naming the reason and a per-reason
count in ``ctx.stats()["fallbacks"]``, when it uses something our strategies do not implement
(FP8 comms, PipeFusion KV cache, GQA, causal masks, dropout, attention_kwargs, an explicit
backend, head balancing). xFuser's USP runs correctly on the TAS-placed groups.

CLI. ``install()`` (run by the ``.pth`` autoloader on the first ``import xfuser``) replaces
``xFuserArgs`` by a dataclass subclass with ``sp_strategy`` and ``topology`` fields and the
flags ``--sp_strategy {usp,tas,torus,swiftfusion,auto}`` / ``--topology NxM`` (xFuser's
FlexibleArgumentParser also accepts ``--sp-strategy``). When the flag is given,
``create_config()`` calls ``use_strategy`` before xFuser builds its groups, so xFuser's
runner (``xdit`` / ``torchrun -m xfuser.runner``) and example scripts run on the strategy.
Degrees: given ``--ulysses_degree/--ring_degree`` are honoured for ``usp`` and validated
against topology and heads for the others; omitted (both 1 on a larger world), the mesh is
``choose_mesh`` (TAS rule ``P_u = gcd(N*M, H)``; H read from the checkpoint's
``transformer/config.json``). ``xdit`` infers ``--nproc_per_node`` from ``--topology`` /
``$SWIFTFUSION_TOPOLOGY`` when no degree is given.

Flux (runner wrapper ``xFuserFlux1Transformer2DWrapper``), fixed while a strategy is routed:
1. an image length not divisible by the SP degree calls the missing ``_pad_to_sp_divisible``
   (and xFuser's zero padding would be attended to): a clear error naming the constraint;
2. a text length not divisible by the SP degree replicates text on every rank and USP then
   counts text K/V once per rank (~4e-2 error): the text is passed as joint tensors
   (``joint_strategy="front"``) instead, exact for every strategy including ``usp``.
The same changes as source diffs: ``patches/xfuser-0.7.0-plugin.patch``.
"""
from __future__ import annotations

import argparse
import contextvars
import functools
import os
import sys
import threading
from dataclasses import dataclass, field
from types import ModuleType

import torch
import torch.distributed as dist

from . import xfuser_compat
from .context import SequenceParallelContext, init_sequence_parallel
from .log import get_logger, log_once
from .strategies import STRATEGIES
from .topology import Mesh, Topology, TopologyError, choose_mesh, detect_topology

logger = get_logger(__name__)

_DEGREE_FLAGS = ("data_parallel_degree", "pipefusion_parallel_degree", "tensor_parallel_degree")


class PluginError(ValueError):
    """A ``--sp-strategy`` setting that cannot run; the message names the constraint and fix."""


# ---------------------------------------------------------------------------------------------
# Mesh planning (shared by the CLI checks, xdit's process count and use_strategy)
# ---------------------------------------------------------------------------------------------

def check_strategy(strategy: str) -> None:
    """Raise ``PluginError`` unless ``strategy`` is one of ``strategies.STRATEGIES``."""
    if strategy not in STRATEGIES:
        raise PluginError(f"unknown --sp-strategy {strategy!r}; choose one of "
                          f"{', '.join(STRATEGIES)}")


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
    placement = "usp" if strategy == "usp" else "tas"
    try:
        return choose_mesh(topology, num_heads, placement, u, r)
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


# ---------------------------------------------------------------------------------------------
# USP routing
# ---------------------------------------------------------------------------------------------

@dataclass
class _Route:
    ctx: SequenceParallelContext
    original: object          # xFuser's USP
    owns_state: bool          # we built xFuser's parallel state (restore tears it down)
    lock: threading.Lock = field(default_factory=threading.Lock)


_route: _Route | None = None
_flux_text = contextvars.ContextVar("swiftfusion_flux_replicated_text", default=None)
_lock = threading.RLock()


def _usp_module() -> ModuleType:
    from xfuser.model_executor.layers import usp
    return usp


def original_usp():
    """xFuser's own USP function, also while its calls are routed to a strategy."""
    route = _route
    return route.original if route is not None else _usp_module().USP


def _rebind(old: object, new: object, name: str = "USP") -> None:
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


def _fallback_reason(query, key, value, dropout_p, is_causal, attn_layer, backend,
                     attention_kwargs, head_balance_layer, kv_head_repeat, joint_strategy,
                     num_heads) -> str | None:
    """Why this USP call needs xFuser's own USP, or None when the strategy can run it."""
    from xfuser.core.distributed import get_runtime_state, get_ulysses_parallel_world_size
    from xfuser.model_executor.layers.usp import _has_kv_cache

    state = get_runtime_state()
    fp8_module = attn_layer if attn_layer is not None else head_balance_layer
    if (getattr(state, "fp8_comms", None) is not None and fp8_module is not None
            and not joint_strategy and get_ulysses_parallel_world_size() > 1):
        return "FP8 communication (--use_fp8_comms)"
    if _has_kv_cache(attn_layer):
        return "PipeFusion KV cache"
    if kv_head_repeat != 1 or key.shape[1] != query.shape[1]:
        return "grouped-query attention (kv_head_repeat > 1)"
    if is_causal:
        return "causal mask"
    if dropout_p:
        return "dropout > 0"
    if backend is not None:
        return f"explicit attention backend {getattr(backend, 'name', backend)}"
    if attention_kwargs and any(v is not None for v in attention_kwargs.values()):
        return f"attention_kwargs {sorted(k for k, v in attention_kwargs.items() if v is not None)}"
    if (head_balance_layer is not None
            and getattr(state.runtime_config, "use_spargeattn_head_balance", False)):
        return "sparge head balancing"
    if query.shape[1] != num_heads:
        return f"{query.shape[1]} heads (the strategy was set up for {num_heads})"
    return None


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
        from xfuser.model_executor.layers import usp
        return usp.USP(query, key, value, dropout_p, is_causal, joint_query, joint_key,
                       joint_value, joint_strategy, attn_layer, combine_qkv_a2a, backend,
                       attention_kwargs, head_balance_layer, kv_head_repeat)
    text = _flux_text.get()
    if text is not None and joint_strategy is None and query.shape[2] > text:
        # Flux with replicated text rows in front: attend to them once, as joint tokens.
        # [B, H, T + S_local, D] -> text [B, H, T, D] + image [B, H, S_local, D]
        joint_query, query = query[:, :, :text], query[:, :, text:]
        joint_key, key = key[:, :, :text], key[:, :, text:]
        joint_value, value = value[:, :, :text], value[:, :, text:]
        joint_strategy = "front"
    ctx = route.ctx
    reason = _fallback_reason(query, key, value, dropout_p, is_causal, attn_layer, backend,
                              attention_kwargs, head_balance_layer, kv_head_repeat,
                              joint_strategy, ctx.num_heads)
    if ctx.strategy == "usp" or reason is not None:
        if reason is not None:
            log_once(logger, f"fallback-{ctx.strategy}-{reason}",
                     f"{ctx.strategy}: this attention call uses {reason}, which the strategy does "
                     "not implement; running xFuser's own USP for such calls (counted in "
                     "ctx.stats()['fallbacks'])")
            with route.lock:
                ctx.fallbacks[reason] = ctx.fallbacks.get(reason, 0) + 1
        else:
            ctx.calls += 1
        return route.original(query, key, value, dropout_p, is_causal, joint_query, joint_key,
                              joint_value, joint_strategy, attn_layer, combine_qkv_a2a, backend,
                              attention_kwargs, head_balance_layer, kv_head_repeat)
    return ctx.attention(query, key, value, joint_query=joint_query, joint_key=joint_key,
                         joint_value=joint_value, joint_strategy=joint_strategy)


def _ensure_xfuser_state(strategy: str, mesh: Mesh) -> bool:
    """Build xFuser's groups for ``mesh`` (True) or check the existing ones agree (False)."""
    from . import xfuser_state as xs

    placement = "usp" if strategy == "usp" else "tas"
    if not xs.xfuser_parallel_initialized():
        xs.init_xfuser_parallel(mesh.ulysses, mesh.ring, placement)
        return True
    u, r, sp_ranks = xs.xfuser_sp_layout()
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
        xs.check_group_agreement(u, r, placement)
    except AssertionError as exc:
        raise PluginError(f"xFuser's groups do not have the {placement!r} placement that "
                          f"{strategy} needs ({exc}); initialise xFuser through use_strategy or "
                          "--sp-strategy") from None
    return False


def use_strategy(strategy: str, num_heads: int, topology: str | None = None, *,
                 ulysses_degree: int | None = None, ring_degree: int | None = None,
                 timeout_s: float | None = None) -> SequenceParallelContext:
    """Route xFuser's ``USP`` (every model) to ``strategy``; return its context.

    Call after ``torch.distributed`` is initialised. Builds xFuser's parallel state with the
    strategy's placement (``"tas"``; ``"usp"`` for usp) and degrees when it does not exist yet,
    otherwise checks that it agrees (``PluginError`` naming the mismatch). ``topology``:
    ``"NxM"`` override (else ``$SWIFTFUSION_TOPOLOGY`` / detection). One strategy at a time:
    ``restore_usp()`` first to switch.
    """
    global _route
    check_strategy(strategy)
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("use_strategy needs torch.distributed initialised (torchrun + "
                           "dist.init_process_group, or xFuserArgs.create_config())")
    xfuser_compat.apply()
    with _lock:
        if _route is not None:
            raise RuntimeError(f"strategy {_route.ctx.strategy!r} is already routed; call "
                               "restore_usp() before use_strategy() again")
        topo = detect_topology(dist.get_world_size(), topology)
        mesh = plan_mesh(strategy, num_heads, topo, ulysses_degree, ring_degree)
        install()
        usp = _usp_module()
        from . import xfuser_state as xs
        owns = _ensure_xfuser_state(strategy, mesh)
        try:  # xFuser's groups exist now: a usp context runs on them (and leaves them alone)
            ctx = init_sequence_parallel(strategy, num_heads, topo, ulysses_degree=mesh.ulysses,
                                         ring_degree=mesh.ring, timeout_s=timeout_s)
        except BaseException:
            if owns:
                xs.destroy_xfuser_parallel()
            raise
        _route = _Route(ctx, usp.USP, owns)
        _rebind(usp.USP, routed_usp)
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
        _rebind(routed_usp, route.original)
    stats = route.ctx.stats()
    logger.info(f"rank {route.ctx.rank}: {stats['strategy']} ({stats['mesh']}): "
                f"{stats['calls']} attention calls, fallbacks {stats['fallbacks']}, "
                f"inter-node bytes {stats['inter_node_bytes']}")
    route.ctx.close()
    if route.owns_state:
        from .xfuser_state import destroy_xfuser_parallel
        destroy_xfuser_parallel()


def routed_context() -> SequenceParallelContext | None:
    """The context xFuser's USP is routed to, or None."""
    route = _route
    return route.ctx if route is not None else None


# ---------------------------------------------------------------------------------------------
# Flux runner wrapper fixes
# ---------------------------------------------------------------------------------------------

def _patch_flux_wrapper(module: ModuleType) -> None:
    """While a strategy is routed: clear error for image lengths not divisible by the SP
    degree (bug 1), text passed as joint tokens when its length is not (bug 2)."""
    cls = module.xFuserFlux1Transformer2DWrapper
    original = cls.forward
    if getattr(original, "__swiftfusion__", False):
        return

    @functools.wraps(original)
    def forward(self, hidden_states, encoder_hidden_states=None, *args, **kwargs):
        if _route is None:
            return original(self, hidden_states, encoder_hidden_states, *args, **kwargs)
        sp = module.get_sequence_parallel_world_size()
        if hidden_states.shape[1] % sp:
            raise PluginError(
                f"Flux: {hidden_states.shape[1]} image tokens are not divisible by the SP degree "
                f"{sp} (xFuser 0.7.0 would pad them with tokens every query attends to); choose "
                f"height and width so that (height/16)*(width/16) is a multiple of {sp}")
        text = encoder_hidden_states.shape[-2]
        token = _flux_text.set(text if text % sp else None)
        try:
            return original(self, hidden_states, encoder_hidden_states, *args, **kwargs)
        finally:
            _flux_text.reset(token)

    forward.__swiftfusion__ = True
    cls.forward = forward


# ---------------------------------------------------------------------------------------------
# CLI: xFuserArgs subclass, parse-time checks, xdit process count
# ---------------------------------------------------------------------------------------------

def _add_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("SwiftFusion (xfuser-swiftfusion)")
    group.add_argument("--sp_strategy", choices=STRATEGIES, default=None,
                       help="sequence-parallel attention strategy: usp (xFuser's own), tas, "
                            "torus, swiftfusion, auto. Without --ulysses_degree/--ring_degree "
                            "the mesh follows the TAS rule P_u = gcd(N*M, heads).")
    group.add_argument("--topology", default=None,
                       help="machines x GPUs per machine, NxM (default: $SWIFTFUSION_TOPOLOGY, "
                            "else detected from the launcher)")
    parse_args = parser.parse_args

    def checked_parse_args(args=None, namespace=None):
        ns = parse_args(args, namespace)
        try:
            _check_namespace(ns)
        except (PluginError, TopologyError) as exc:
            parser.error(str(exc))
        return ns

    parser.parse_args = checked_parse_args
    return parser


def _degrees_of(args) -> tuple[int | None, int | None]:
    """Given (Ulysses, Ring) degrees, or (None, None) when omitted (both 1)."""
    u, r = getattr(args, "ulysses_degree", None) or 1, getattr(args, "ring_degree", None) or 1
    return (None, None) if u == 1 and r == 1 else (u, r)


def _check_namespace(args) -> None:
    """Parse-time checks of a ``--sp-strategy`` run (every rank, before any model loads)."""
    if not getattr(args, "sp_strategy", None):
        return
    check_strategy(args.sp_strategy)
    for flag in _DEGREE_FLAGS:
        if (getattr(args, flag, 1) or 1) > 1:
            raise PluginError(f"--sp-strategy {args.sp_strategy} runs sequence parallelism over "
                              f"all ranks; --{flag} > 1 is not supported with it")
    if getattr(args, "use_cfg_parallel", False):
        raise PluginError(f"--sp-strategy {args.sp_strategy} runs sequence parallelism over all "
                          "ranks; --use_cfg_parallel is not supported with it")
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    topo = detect_topology(world, args.topology)
    u, r = _degrees_of(args)
    try:
        heads = read_num_heads(args.model, local_files_only=True)
    except PluginError:
        heads = None   # checked again (with the error) when the run starts
    if world > 1 or u is not None:
        plan_mesh(args.sp_strategy, heads, topo, u, r)


def _make_args_class(base: type) -> type:
    @dataclass
    class SwiftFusionArgs(base):
        """xFuser's arguments plus ``--sp_strategy`` and ``--topology`` (xfuser-swiftfusion)."""

        sp_strategy: str | None = None
        topology: str | None = None

        @staticmethod
        def add_cli_args(parser):
            return _add_flags(base.add_cli_args(parser))

        @staticmethod
        def add_runner_args(parser):
            return _add_flags(base.add_runner_args(parser))

        def create_config(self):
            if self.sp_strategy:
                self.ulysses_degree, self.ring_degree = route_sp_strategy(self)
            return super().create_config()

    SwiftFusionArgs.__swiftfusion__ = True
    return SwiftFusionArgs


def route_sp_strategy(args) -> tuple[int, int]:
    """``use_strategy`` for xFuser arguments with ``sp_strategy`` set (once per process);
    returns the (Ulysses, Ring) degrees xFuser must be configured with."""
    ctx = routed_context()
    if ctx is None:
        _check_namespace(args)
        if not dist.is_initialized():
            from xfuser.core.distributed import init_distributed_environment
            init_distributed_environment()
        u, r = _degrees_of(args)
        ctx = use_strategy(args.sp_strategy, read_num_heads(args.model), args.topology,
                           ulysses_degree=u, ring_degree=r)
    elif ctx.strategy != args.sp_strategy:
        raise PluginError(f"--sp-strategy {args.sp_strategy}, but {ctx.strategy} is already "
                          "routed in this process")
    return ctx.mesh.ulysses, ctx.mesh.ring


def _patch_args(args_module: ModuleType) -> None:
    original = args_module.xFuserArgs
    if getattr(original, "__swiftfusion__", False):
        return
    sub = _make_args_class(original)
    args_module.xFuserArgs = sub
    _rebind(original, sub, "xFuserArgs")


def xdit_nproc(args: list[str], default: int) -> int:
    """Processes per node for ``xdit``: xFuser's product of degrees, or, for ``--sp-strategy``
    without degrees, the ``--topology`` / ``$SWIFTFUSION_TOPOLOGY`` world divided by
    ``--nnodes``. Validates the strategy flags first (``PluginError``)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--sp_strategy", "--sp-strategy", default=None)
    p.add_argument("--topology", default=None)
    p.add_argument("--model", default=None)
    for name in ("ulysses_degree", "ring_degree", "nnodes"):
        p.add_argument(f"--{name}", f"--{name.replace('_', '-')}", type=int, default=None)
    ns, _ = p.parse_known_args(args)
    if not ns.sp_strategy:
        return default
    check_strategy(ns.sp_strategy)
    nnodes = ns.nnodes or 1
    topo_text = ns.topology or os.environ.get("SWIFTFUSION_TOPOLOGY")
    if ns.ulysses_degree is None and ns.ring_degree is None:
        if not topo_text:
            raise PluginError(f"--sp-strategy {ns.sp_strategy} without --ulysses_degree/"
                              "--ring_degree needs the world size: pass --topology NxM "
                              "(machines x GPUs per machine) or --nproc_per_node")
        topo = Topology.parse(topo_text)
        if topo.world_size % nnodes:
            raise PluginError(f"--topology {topo} ({topo.world_size} ranks) does not split over "
                              f"--nnodes {nnodes}")
        return topo.world_size // nnodes
    if topo_text:
        plan_mesh(ns.sp_strategy, None, Topology.parse(topo_text), ns.ulysses_degree,
                  ns.ring_degree)
    return default


def _patch_xdit(cli: ModuleType) -> None:
    original = cli.get_nproc_from_args
    if getattr(original, "__swiftfusion__", False):
        return

    @functools.wraps(original)
    def get_nproc_from_args(args):
        try:
            return xdit_nproc(list(args), original(args))
        except (PluginError, TopologyError) as exc:
            sys.stderr.write(f"xdit: error: {exc}\n")
            raise SystemExit(2) from None

    get_nproc_from_args.__swiftfusion__ = True
    cli.get_nproc_from_args = get_nproc_from_args


def _patch_runtime_teardown(runtime_state: ModuleType) -> None:
    """The runner's cleanup tears xFuser's groups down: close the routed context first."""
    cls = runtime_state.RuntimeState
    original = cls.destroy_distributed_env
    if getattr(original, "__swiftfusion__", False):
        return

    @functools.wraps(original)
    def destroy_distributed_env(self):
        route = _route
        if route is not None:
            route.owns_state = False   # xFuser destroys its own groups next
            restore_usp()
        return original(self)

    destroy_distributed_env.__swiftfusion__ = True
    cls.destroy_distributed_env = destroy_distributed_env


_installed = False


def install() -> None:
    """Register the xFuser hooks (idempotent; cheap until xFuser modules load)."""
    global _installed
    if _installed:
        return
    with _lock:
        if _installed:
            return
        xfuser_compat.apply()
        hooks = (
            ("xfuser.config.args", _patch_args),
            ("xfuser.cli", _patch_xdit),
            ("xfuser.core.distributed.runtime_state", _patch_runtime_teardown),
            ("xfuser.model_executor.models.transformers.transformer_flux", _patch_flux_wrapper),
        )
        for name, hook in hooks:
            xfuser_compat.add_post_import_hook(name, hook)
        xfuser_compat.add_post_import_prefix_hook("xfuser.", _rebind_new_module)
        _installed = True


__all__ = ["use_strategy", "restore_usp", "routed_context", "routed_usp", "install",
           "route_sp_strategy",
           "plan_mesh", "read_num_heads", "check_strategy", "xdit_nproc", "PluginError"]
