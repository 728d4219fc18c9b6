"""xFuser's distributed and runtime state inside an already initialised torch.distributed world.

Our emulated-cluster launcher (and any torchrun script) initialises the default process group
itself; this module brings up xFuser's own state on top of it, exactly the way xFuser does, so
that xFuser's module-level ``USP()`` runs unmodified:

- ``init_distributed_environment`` (keeps the existing default group, builds xFuser's world
  GroupCoordinator), ``initialize_model_parallel(classifier_free_guidance_degree=C,
  sequence_parallel_degree=W/C, ulysses_degree=, ring_degree=)`` (xFuser's SP groups +
  ``yunchang.set_seq_parallel_pg``);
- a runtime state built from an ``EngineConfig`` that ``xFuserArgs(...).create_config()``
  produces (xFuser's ``ExternalRuntimeState`` class, "xDiT components outside xDiT").

Placements (``mesh.py``): ``"usp"`` (xFuser's own, Ulysses groups contiguous) and ``"tas"``
(ours, Ring groups contiguous, Ulysses strided across machines).

CFG parallelism (``C = 2``): xFuser's rank order ``tp-sp-pp-cfg-dp`` (``RankGenerator``) with
tensor, pipeline and data parallelism off makes the SP groups contiguous blocks of ``W/C``
ranks (``cfg_sp_groups``: ``[0, W/2)`` and ``[W/2, W)``); each is one ``SPGroups`` member
set, with our placement inside it.

Groups come from the one groups module (``groups.SPGroups``): ``initialize_model_parallel`` does
``from yunchang import set_seq_parallel_pg`` inside its body, so ``yunchang.set_seq_parallel_pg``
is rebound, for that one call, to a function that hands yunchang the Ulysses and Ring process
groups of our ``DeviceMesh`` instead of building its own. ``check_group_agreement`` compares
xFuser's view of the groups with the same ``SPGroups``.
"""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from ...groups import SPGroups, build_groups
from ...mesh import PLACEMENTS, Mesh
from ...topology import Topology
from . import compat


def cfg_sp_groups(world_size: int, cfg_degree: int = 1) -> list[tuple[int, ...]]:
    """xFuser's SP groups on ``world_size`` ranks with CFG degree ``cfg_degree`` (tensor,
    pipeline and data parallelism 1), from xFuser's own ``RankGenerator``."""
    from xfuser.core.distributed.utils import RankGenerator
    if cfg_degree < 1 or world_size % cfg_degree:
        raise ValueError(f"CFG degree {cfg_degree} does not divide the world size {world_size}")
    gen = RankGenerator(1, world_size // cfg_degree, 1, cfg_degree, 1, 1, "tp-sp-pp-cfg-dp")
    return [tuple(g) for g in gen.get_ranks("sp")]


def sp_groups(ulysses_degree: int, ring_degree: int, placement: str,
              cfg_degree: int = 1) -> SPGroups:
    """Our groups for this rank's SP group (``cfg_sp_groups``; the whole world without CFG);
    rank lists do not depend on the machines, only on the placement and degrees."""
    sp = ulysses_degree * ring_degree
    groups = cfg_sp_groups(sp * cfg_degree, cfg_degree)
    members = next(g for g in groups if dist.get_rank() in g)
    return build_groups(Mesh(Topology(1, sp), ulysses_degree, ring_degree, placement),
                        members=members, sp_groups=groups)


@contextlib.contextmanager
def _yunchang_groups(groups: SPGroups) -> Iterator[None]:
    """Rebind yunchang.set_seq_parallel_pg for one initialize_model_parallel call: it installs
    the Ulysses and Ring process groups of ``groups``."""
    import yunchang
    from yunchang.globals import PROCESS_GROUP
    original = yunchang.set_seq_parallel_pg

    def set_seq_parallel_pg(sp_ulysses_degree, sp_ring_degree, rank, world_size, **_):
        if (sp_ulysses_degree, sp_ring_degree) != (groups.mesh.ulysses, groups.mesh.ring):
            raise AssertionError(f"xFuser asks for Ulysses {sp_ulysses_degree} x Ring "
                                 f"{sp_ring_degree}, our mesh is {groups.mesh.describe()}")
        PROCESS_GROUP.ULYSSES_PG = groups.ulysses_group()
        PROCESS_GROUP.RING_PG = groups.ring_group()

    yunchang.set_seq_parallel_pg = set_seq_parallel_pg
    try:
        yield
    finally:
        yunchang.set_seq_parallel_pg = original


def _group_ranks(group) -> list[int]:
    return sorted(dist.get_process_group_ranks(group))


def check_group_agreement(groups: SPGroups) -> None:
    """Assert yunchang's ULYSSES_PG/RING_PG and xFuser's get_sp_group() match ``groups``."""
    from yunchang.globals import PROCESS_GROUP
    from xfuser.core.distributed import parallel_state as ps

    sp = ps.get_sp_group()
    rank = dist.get_rank()
    ulysses_degree, ring_degree = groups.mesh.ulysses, groups.mesh.ring
    uly_ranks = _group_ranks(PROCESS_GROUP.ULYSSES_PG)
    ring_ranks = _group_ranks(PROCESS_GROUP.RING_PG)
    want_uly = sorted(map(groups.to_global, groups.ulysses_ranks))
    want_ring = sorted(map(groups.to_global, groups.ring_ranks))
    problems = []
    if uly_ranks != want_uly:
        problems.append(f"yunchang Ulysses group {uly_ranks} != expected {want_uly}")
    if ring_ranks != want_ring:
        problems.append(f"yunchang Ring group {ring_ranks} != expected {want_ring}")
    if sp.ulysses_group is not PROCESS_GROUP.ULYSSES_PG or sp.ring_group is not PROCESS_GROUP.RING_PG:
        problems.append("xFuser SP coordinator does not hold yunchang's Ulysses/Ring groups")
    sizes = (ps.get_ulysses_parallel_world_size(), ps.get_ring_parallel_world_size())
    if sizes != (ulysses_degree, ring_degree) or (len(uly_ranks), len(ring_ranks)) != sizes:
        problems.append(f"xFuser (Ulysses, Ring) sizes {sizes}, yunchang group sizes "
                        f"{(len(uly_ranks), len(ring_ranks))}, requested "
                        f"{(ulysses_degree, ring_degree)}")
    if ps.get_ulysses_parallel_rank() != uly_ranks.index(rank):
        problems.append(f"xFuser Ulysses rank {ps.get_ulysses_parallel_rank()} != "
                        f"{uly_ranks.index(rank)}")
    if ps.get_ring_parallel_rank() != ring_ranks.index(rank):
        problems.append(f"xFuser Ring rank {ps.get_ring_parallel_rank()} != {ring_ranks.index(rank)}")
    if list(sp.ranks) != list(groups.global_members):
        problems.append(f"xFuser SP group {sp.ranks} is not our SP group "
                        f"{list(groups.global_members)}")
    cfg = ps.get_classifier_free_guidance_world_size()
    if cfg != len(groups.all_sp_groups):
        problems.append(f"xFuser CFG degree {cfg}, our SP groups {len(groups.all_sp_groups)}")
    if problems:
        raise AssertionError(f"rank {rank}, placement {groups.mesh.placement}: " + "; ".join(problems))


def _check_backend_lse(backend) -> None:
    """Ring > 1 merges partial results by LSE: refuse a backend whose LSE is missing or wrong
    (e.g. SDPA returns None; yunchang's TORCH_MATH returns zeros)."""
    from xfuser.core.distributed.attention_backend import ATTENTION_FUNCTION_REGISTRY
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 3, 8, generator=g) for _ in range(3))
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    q, k, v = (t.to(device, torch.float16 if device.type == "cuda" else torch.float32)
               for t in (q, k, v))
    try:
        _, lse = ATTENTION_FUNCTION_REGISTRY[backend](q, k, v, dropout_p=0.0, is_causal=False)
    except Exception:  # backend cannot run on this probe: leave the judgement to xFuser
        return
    ref = torch.logsumexp(q.double() @ k.double().transpose(-1, -2) / 8 ** 0.5, dim=-1)
    if lse is None or lse.reshape(ref.shape).double().sub(ref).abs().max().item() > 1e-2:
        raise RuntimeError(f"attention backend {backend.name} returns no correct LSE; "
                           "USP's ring (ring_degree > 1) would be wrong")


def init_xfuser_parallel(ulysses_degree: int, ring_degree: int, placement: str = "usp",
                         groups: SPGroups | None = None, cfg_degree: int | None = None) -> None:
    """Bring up xFuser's groups and runtime state the xFuser way: SP over the whole world, or,
    with CFG degree 2 (``cfg_degree``, or two SP groups in ``groups``), over each half; on
    ``groups`` (default: ``sp_groups(ulysses_degree, ring_degree, placement, cfg_degree)``)."""
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown placement {placement!r}; expected one of {PLACEMENTS}")
    if not dist.is_initialized():
        raise RuntimeError("init_xfuser_parallel needs an initialised torch.distributed world")
    world = dist.get_world_size()
    cfg = len(groups.all_sp_groups) if groups is not None else (cfg_degree or 1)
    if cfg_degree is not None and cfg != cfg_degree:
        raise ValueError(f"CFG degree {cfg_degree}, but the groups have {cfg} SP groups")
    if cfg not in (1, 2):
        raise ValueError(f"{cfg} SP groups: xFuser's CFG parallelism has degree 2 "
                         "(--use_cfg_parallel); other splits of the world are not supported")
    if ulysses_degree < 1 or ring_degree < 1 or ulysses_degree * ring_degree * cfg != world:
        raise ValueError(f"ulysses_degree {ulysses_degree} x ring_degree {ring_degree} x CFG "
                         f"degree {cfg} != world size {world}")
    compat.apply()
    groups = groups if groups is not None else sp_groups(ulysses_degree, ring_degree, placement,
                                                         cfg)
    if list(groups.all_sp_groups) != cfg_sp_groups(world, cfg):
        raise ValueError(f"SP groups {[list(g) for g in groups.all_sp_groups]} are not xFuser's "
                         f"{[list(g) for g in cfg_sp_groups(world, cfg)]} for CFG degree {cfg}")

    from xfuser.config import xFuserArgs
    from xfuser.core.distributed import parallel_state as ps
    from xfuser.core.distributed import runtime_state as rs

    # xFuser's world coordinator may exist already (xFuserArgs.create_config builds it); its
    # model-parallel groups must not.
    if ps.model_parallel_is_initialized():
        raise RuntimeError("xFuser parallel state is already initialised; "
                           "call destroy_xfuser_parallel() first")
    try:
        backend = dist.get_backend()
        local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
        ps.init_distributed_environment(world_size=world, rank=dist.get_rank(),
                                        local_rank=local_rank, backend=backend)
        with _yunchang_groups(groups):
            ps.initialize_model_parallel(classifier_free_guidance_degree=cfg,
                                         sequence_parallel_degree=ulysses_degree * ring_degree,
                                         ulysses_degree=ulysses_degree,
                                         ring_degree=ring_degree,
                                         backend=backend)
        # Runtime state: USP reads attention_backend, runtime_config and fp8_comms from it.
        engine_config, _ = xFuserArgs(ulysses_degree=ulysses_degree, ring_degree=ring_degree,
                                      use_cfg_parallel=cfg == 2).create_config()
        state = rs.ExternalRuntimeState.__new__(rs.ExternalRuntimeState)
        rs.RuntimeState.__init__(state, engine_config)  # ExternalRuntimeState: no env re-init
        rs._RUNTIME = state
        if ring_degree > 1:
            _check_backend_lse(state.attention_backend)
        check_group_agreement(groups)
    except BaseException:
        destroy_xfuser_parallel()  # leave no half-built state behind
        raise


_routed_original: Callable | None = None


def hold_original_usp(fn: Callable | None) -> None:
    """Routing rebinds xFuser's ``USP``; it leaves the original here while it does."""
    global _routed_original
    _routed_original = fn


def original_usp() -> Callable:
    """xFuser's own USP function, also while its calls are routed to a strategy."""
    if _routed_original is not None:
        return _routed_original
    from xfuser.model_executor.layers import usp
    return usp.USP


def xfuser_usp(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               joint_query: torch.Tensor | None = None,
               joint_key: torch.Tensor | None = None,
               joint_value: torch.Tensor | None = None,
               joint_strategy: str | None = None) -> torch.Tensor:
    """xFuser's module-level USP on [B, H, S_local, D] shards (SP rank i: tokens i*S_local...).

    Joint tensors are replicated [B, H, T, D]; with joint_strategy "front"/"rear" the output
    is [B, H, T + S_local, D] with the text rows first/last, exactly as USP returns it.
    """
    return original_usp()(q, k, v, joint_query=joint_query, joint_key=joint_key,
                          joint_value=joint_value, joint_strategy=joint_strategy)


def xfuser_parallel_initialized() -> bool:
    """True when xFuser's model-parallel groups exist (whoever built them)."""
    ps = sys.modules.get("xfuser.core.distributed.parallel_state")
    return ps is not None and ps.model_parallel_is_initialized()


def xfuser_sp_layout() -> tuple[int, int, list[int]]:
    """(Ulysses degree, Ring degree, SP group ranks) of xFuser's current parallel state."""
    from xfuser.core.distributed import parallel_state as ps
    return (ps.get_ulysses_parallel_world_size(), ps.get_ring_parallel_world_size(),
            sorted(ps.get_sp_group().ranks))


def xfuser_attention_backend() -> str | None:
    """The name of the attention backend in xFuser's runtime state (``"CUDNN"``,
    ``"SDPA_EFFICIENT"``, ...: what its USP calls), or None without a runtime state."""
    rs = sys.modules.get("xfuser.core.distributed.runtime_state")
    backend = getattr(getattr(rs, "_RUNTIME", None), "attention_backend", None)
    return None if backend is None else backend.name


def xfuser_cfg_degree() -> int:
    """xFuser's current CFG degree (2 with ``--use_cfg_parallel``)."""
    from xfuser.core.distributed import parallel_state as ps
    return ps.get_classifier_free_guidance_world_size()


def ring_rotate_method() -> str:
    """The K/V rotation torch's _templated_ring_attention (USP's ring) currently uses."""
    from torch.distributed.tensor.experimental._attention import _cp_options
    return _cp_options.rotate_method.name.lower().replace("_", "")


def destroy_xfuser_parallel() -> None:
    """Tear xFuser/yunchang state down (keeps the default process group) so init can rerun."""
    if "xfuser.core.distributed.parallel_state" not in sys.modules:
        return
    from xfuser.core.distributed import parallel_state as ps
    from xfuser.core.distributed import runtime_state as rs
    from yunchang.globals import PROCESS_GROUP

    rs._RUNTIME = None
    # the Ulysses / Ring groups are our DeviceMesh's (reused by the next init): not destroyed
    PROCESS_GROUP.ULYSSES_PG = None
    PROCESS_GROUP.RING_PG = None
    ps.destroy_model_parallel()
    if ps._DIT is not None and dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group(ps._DIT)
    ps._DIT = None
    # destroy_distributed_environment() would also destroy the default group, which belongs
    # to whoever initialised torch.distributed; drop only xFuser's world coordinator.
    if ps._WORLD is not None:
        ps._WORLD.destroy()
        ps._WORLD = None


__all__ = ["init_xfuser_parallel", "xfuser_usp", "original_usp", "hold_original_usp",
           "destroy_xfuser_parallel", "xfuser_parallel_initialized", "xfuser_sp_layout",
           "check_group_agreement", "sp_groups", "cfg_sp_groups", "xfuser_cfg_degree",
           "ring_rotate_method"]
