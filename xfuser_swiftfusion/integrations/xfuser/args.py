"""``--sp-strategy`` and ``--topology`` in xFuser's own CLI: the ``xFuserArgs`` subclass, its
parse-time checks, and ``xdit``'s process count.

``install()`` (``__init__``) replaces ``xFuserArgs`` by a dataclass subclass with
``sp_strategy``, ``topology``, ``sf_cuda_graphs`` and ``sf_launches`` fields and the flags
``--sp_strategy`` / ``--topology NxM`` / ``--sf_cuda_graphs on|off`` / ``--sf_launches
stage|ring`` (xFuser's FlexibleArgumentParser also accepts ``--sp-strategy`` and the like). When the flag is given,
``create_config()`` calls ``use_strategy`` before xFuser builds its groups, so xFuser's runner
(``xdit`` / ``torchrun -m xfuser.runner``) and example scripts run on the strategy. Degrees:
given ``--ulysses_degree/--ring_degree`` are honoured for ``usp`` and validated against topology
and heads for the others; omitted (both 1 on a larger world), the mesh is ``choose_mesh`` (TAS
rule ``P_u = gcd(N*M, H)``; H read from the checkpoint's ``transformer/config.json``). ``xdit``
infers ``--nproc_per_node`` from ``--topology`` / ``$SWIFTFUSION_TOPOLOGY`` when no degree is
given.

``--topology`` describes the whole world. With ``--use_cfg_parallel`` each CFG half is one SP
group (xFuser's ranks ``[0, W/2)`` and ``[W/2, W)``) and the strategy runs on each, on that
half's machines (``N/2`` machines each, or part of one machine); the degrees are the SP
group's (``Ulysses x Ring = W/2``). PipeFusion, tensor and data parallelism are refused with
``--sp-strategy`` (``_UNSUPPORTED``: the message names the combination and what to use).
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
from dataclasses import dataclass
from types import ModuleType

import torch.distributed as dist

from ...strategies.registry import names, specs
from ...topology import Topology, TopologyError, detect_topology
from . import state
from .routing import (PluginError, cfg_sp_topology, check_sp_degrees, check_strategy, plan_mesh,
                      read_num_heads, rebind, routed_context, use_strategy)

# flag -> (what it is, why the strategies do not run with it)
_UNSUPPORTED = {
    "pipefusion_parallel_degree": (
        "PipeFusion", "its patch pipeline runs xFuser's own attention with stale-KV buffers, "
        "which the strategies do not implement"),
    "tensor_parallel_degree": (
        "tensor parallelism", "xFuser places tensor-parallel ranks innermost, so each SP group "
        "would be strided over the machines, and the strategies' attention is not split by "
        "tensor-parallel heads"),
    "data_parallel_degree": (
        "data parallelism", "data-parallel replicas may make different numbers of attention "
        "calls, while the strategies allocate symmetric buffers over all ranks"),
}


def _add_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("SwiftFusion (xfuser-swiftfusion)")
    group.add_argument("--sp_strategy", choices=names(), default=None,
                       help="sequence-parallel attention strategy: " + "; ".join(
                           f"{s.name}: {s.summary}" for s in specs()) + ". Without "
                            "--ulysses_degree/--ring_degree the mesh follows the TAS rule "
                            "P_u = gcd(N*M, heads).")
    group.add_argument("--topology", default=None,
                       help="machines x GPUs per machine, NxM (default: $SWIFTFUSION_TOPOLOGY, "
                            "else detected from the launcher)")
    group.add_argument("--sf_cuda_graphs", choices=("on", "off"), default=None,
                       help="run each attention layer's execution plan as a CUDA graph "
                            "(default: $SWIFTFUSION_CUDA_GRAPHS, else on with CUDA)")
    group.add_argument("--sf_launches", choices=("stage", "ring"), default=None,
                       help="torus/swiftfusion attention launches: one per Torus stage and query "
                            "block (stage, the default with CUDA) or one per ring step (ring)")
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
    for flag, (name, why) in _UNSUPPORTED.items():
        n = getattr(args, flag, 1) or 1
        if n > 1:
            raise PluginError(
                f"--sp-strategy {args.sp_strategy} with --{flag} {n} ({name}) is not supported: "
                f"{why}. Use --{flag} 1 with --sp-strategy (sequence parallelism, optionally "
                f"with --use_cfg_parallel), or drop --sp-strategy to run {name} with xFuser's "
                "own USP")
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    topo = detect_topology(world, args.topology)
    cfg = _cfg_degree_of(args)
    _, sp_topo = cfg_sp_topology(args.sp_strategy, topo, cfg)
    u, r = _degrees_of(args)
    check_sp_degrees(args.sp_strategy, sp_topo, cfg, u, r)
    try:
        heads = read_num_heads(args.model, local_files_only=True)
    except PluginError:
        heads = None   # checked again (with the error) when the run starts
    if sp_topo.world_size > 1 or u is not None:
        plan_mesh(args.sp_strategy, heads, sp_topo, u, r)


def _cfg_degree_of(args) -> int:
    """2 with ``--use_cfg_parallel`` (xFuser's CFG degree), else 1."""
    return 2 if getattr(args, "use_cfg_parallel", False) else 1


def _make_args_class(base: type) -> type:
    @dataclass
    class SwiftFusionArgs(base):
        """xFuser's arguments plus ``--sp_strategy`` and ``--topology`` (xfuser-swiftfusion)."""

        sp_strategy: str | None = None
        topology: str | None = None
        sf_cuda_graphs: str | None = None
        sf_launches: str | None = None

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
                           ulysses_degree=u, ring_degree=r, cfg_degree=_cfg_degree_of(args),
                           fp8_comms=bool(getattr(args, "use_fp8_comms", False)),
                           options=strategy_options(args))
    elif ctx.strategy != args.sp_strategy:
        raise PluginError(f"--sp-strategy {args.sp_strategy}, but {ctx.strategy} is already "
                          "routed in this process")
    # xFuser's groups: the strategy's mesh, or the unpadded one when it runs on zero-padded
    # heads (xFuser's own USP, for the calls handed back to it, runs on the real heads)
    u, r, _ = state.xfuser_sp_layout()
    return u, r


def strategy_options(args) -> dict:
    """``init_sequence_parallel`` options of ``--sf-cuda-graphs`` and ``--sf-launches`` (the
    ones given)."""
    out = {}
    graphs = getattr(args, "sf_cuda_graphs", None)
    if graphs is not None:
        out["cuda_graphs"] = graphs == "on"
    if getattr(args, "sf_launches", None) is not None:
        out["launches"] = args.sf_launches
    return out


def patch_args(args_module: ModuleType) -> None:
    original = args_module.xFuserArgs
    if getattr(original, "__swiftfusion__", False):
        return
    sub = _make_args_class(original)
    args_module.xFuserArgs = sub
    rebind(original, sub, "xFuserArgs")


def xdit_nproc(args: list[str], default: int) -> int:
    """Processes per node for ``xdit``: xFuser's product of degrees, or, for ``--sp-strategy``
    without degrees, the ``--topology`` / ``$SWIFTFUSION_TOPOLOGY`` world divided by
    ``--nnodes``. Validates the strategy flags first (``PluginError``)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--sp_strategy", "--sp-strategy", default=None)
    p.add_argument("--topology", default=None)
    p.add_argument("--model", default=None)
    p.add_argument("--use_cfg_parallel", "--use-cfg-parallel", action="store_true")
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
        cfg = _cfg_degree_of(ns)
        _, sp_topo = cfg_sp_topology(ns.sp_strategy, Topology.parse(topo_text), cfg)
        check_sp_degrees(ns.sp_strategy, sp_topo, cfg, ns.ulysses_degree, ns.ring_degree)
        plan_mesh(ns.sp_strategy, None, sp_topo, ns.ulysses_degree, ns.ring_degree)
    return default


def patch_xdit(cli: ModuleType) -> None:
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


