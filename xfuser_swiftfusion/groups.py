"""The mesh as process groups: the one place where a placement becomes ranks and groups.

An SP group (sequence-parallel group) is the whole default group, or one of several disjoint
groups of equal size that together make up the world (xFuser's CFG parallelism: two SP
groups, one per CFG half). ``members`` lists its global ranks in SP-rank order: SP rank ``i``
is global rank ``members[i]``; ``sp_groups`` lists the members of every SP group, in the same
order on every rank.

A ``Mesh`` (``mesh.py``) says which SP rank is GPU ``(t, u, r)``; ``SPGroups`` lays those
ranks out as a ``torch.distributed.device_mesh.DeviceMesh`` with named dimensions
``("torus", "ulysses", "ring")`` (``[T, U, R]``; a mesh whose Ulysses group does not split
into ``T`` machines x ``U`` GPUs is ``[1, P_u, R]``), over the global ranks of every SP group
(``("sp_group", "torus", "ulysses", "ring")``, ``[C, T, U, R]``, with ``C`` SP groups).
Everything else derives from it:

- SP-rank tuples for the transports (``ulysses_ranks``, ``ring_ranks``, ``ring_groups``: the
  two-sided exchanges and the NVSHMEM teams of the one-sided one; the communicators map SP
  ranks to global ranks);
- ``ProcessGroup`` objects (``ulysses_group``: the flattened torus x ulysses dimension,
  ``ring_group``), which xFuser / yunchang are given instead of building their own.

Building the ``DeviceMesh`` is collective over the default group (every SP group's groups are
created on every rank, in one order); it is built once per (mesh, SP groups, device type,
default group) and process, on first use of a process group.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Sequence

import torch
import torch.distributed as dist

from .mesh import Mesh

DIMS = ("torus", "ulysses", "ring")
SP_GROUP_DIM = "sp_group"


def mesh_tensor(mesh: Mesh) -> torch.Tensor:
    """SP ranks ``[T, U, R]`` of ``mesh`` (``[1, P_u, R]`` where the Ulysses group does
    not factor into whole machines); entry ``[t, u, r]`` is GPU ``(t, u, r)``."""
    T, U = mesh.torus, mesh.ulysses_intra
    if T * U != mesh.ulysses:
        T, U = 1, mesh.ulysses
    ranks = [[[mesh.rank_of_g(t * U + u, r) for r in range(mesh.ring)] for u in range(U)]
             for t in range(T)]
    return torch.tensor(ranks, dtype=torch.int64)


def check_sp_groups(sp_groups: Sequence[Sequence[int]], world_size: int) -> tuple[tuple[int, ...], ...]:
    """``sp_groups`` as tuples, or ``ValueError``: disjoint groups of one size covering
    ``0 .. world_size - 1``."""
    groups = tuple(tuple(int(x) for x in g) for g in sp_groups)
    flat = sorted(x for g in groups for x in g)
    if not groups or len({len(g) for g in groups}) != 1 or flat != list(range(world_size)):
        raise ValueError(f"SP groups {[list(g) for g in groups]} must be disjoint groups of one "
                         f"size that cover the {world_size} ranks of the default group")
    return groups


@dataclass(eq=False)
class SPGroups:
    """Groups of one sequence-parallel mesh as seen from SP rank ``rank``.

    ``members``: global rank of each SP rank (None: the SP group is the whole default group,
    SP rank = global rank); ``sp_groups``: every SP group's ``members`` (None: this one only).
    """

    mesh: Mesh
    rank: int
    device_type: str = "cpu"
    members: tuple[int, ...] | None = None
    sp_groups: tuple[tuple[int, ...], ...] | None = None
    _device_mesh: object = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.members is not None:
            self.members = tuple(self.members)
            if len(self.members) != self.mesh.world_size:
                raise ValueError(f"SP group {self.members} has {len(self.members)} ranks, the mesh "
                                 f"{self.mesh.describe()} {self.mesh.world_size}")
        if self.sp_groups is not None:
            self.sp_groups = tuple(tuple(g) for g in self.sp_groups)
            if self.global_members not in self.sp_groups:
                raise ValueError(f"SP group {self.global_members} is not one of {self.sp_groups}")
        if not 0 <= self.rank < self.mesh.world_size:
            raise ValueError(f"SP rank {self.rank} out of range for {self.mesh.world_size} ranks")

    @property
    def global_members(self) -> tuple[int, ...]:
        """Global rank of each SP rank."""
        return self.members if self.members is not None else tuple(range(self.mesh.world_size))

    @property
    def all_sp_groups(self) -> tuple[tuple[int, ...], ...]:
        """Every SP group's global ranks (mine alone when ``sp_groups`` is None)."""
        return self.sp_groups if self.sp_groups is not None else (self.global_members,)

    def to_global(self, sp_rank: int) -> int:
        """The global rank of SP rank ``sp_rank``."""
        return self.global_members[sp_rank]

    @property
    def global_rank(self) -> int:
        return self.to_global(self.rank)

    def for_mesh(self, mesh: Mesh) -> "SPGroups":
        """The groups of another mesh over the same SP group(s) (same SP rank)."""
        return replace(self, mesh=mesh)

    @cached_property
    def ranks(self) -> torch.Tensor:
        """``[T, U, R]`` SP ranks (see ``mesh_tensor``)."""
        return mesh_tensor(self.mesh)

    @cached_property
    def ulysses_groups(self) -> list[tuple[int, ...]]:
        """Every Ulysses group (torus x ulysses), each ordered by Ulysses index g = t*U + u."""
        flat = self.ranks.reshape(-1, self.mesh.ring)  # [T*U, R]
        return [tuple(flat[:, r].tolist()) for r in range(self.mesh.ring)]

    @cached_property
    def ring_groups(self) -> list[tuple[int, ...]]:
        """Every Ring group, each ordered by ring rank r."""
        return [tuple(row) for row in self.ranks.reshape(-1, self.mesh.ring).tolist()]

    @property
    def ulysses_ranks(self) -> tuple[int, ...]:
        """This rank's Ulysses group (SP ranks)."""
        return next(g for g in self.ulysses_groups if self.rank in g)

    @property
    def ring_ranks(self) -> tuple[int, ...]:
        """This rank's Ring group (SP ranks)."""
        return next(g for g in self.ring_groups if self.rank in g)

    @property
    def device_mesh(self):
        """The ``DeviceMesh`` over global ranks (collective on first access: every rank of the
        default group must ask)."""
        if self._device_mesh is None:
            self._device_mesh = _device_mesh(self.mesh, self.all_sp_groups, self.device_type)
        return self._device_mesh

    def ulysses_group(self) -> dist.ProcessGroup:
        """This rank's Ulysses ``ProcessGroup`` (torus x ulysses, flattened)."""
        return _flat_ulysses(self.device_mesh).get_group()

    def ring_group(self) -> dist.ProcessGroup:
        """This rank's Ring ``ProcessGroup``."""
        return self.device_mesh.get_group("ring")


_MESHES: dict[tuple, object] = {}
_FLAT: dict[int, object] = {}


def _flat_ulysses(dm):
    """The torus x ulysses dimensions of ``dm`` as one (flattened once per mesh)."""
    if id(dm) not in _FLAT:
        _FLAT[id(dm)] = dm["torus", "ulysses"]._flatten("sp_ulysses")
    return _FLAT[id(dm)]


def global_mesh_tensor(mesh: Mesh, sp_groups: Sequence[Sequence[int]]) -> torch.Tensor:
    """Global ranks of ``mesh`` in every SP group: ``[T, U, R]`` for one group,
    ``[C, T, U, R]`` for ``C`` groups (entry ``[c, t, u, r]``: GPU ``(t, u, r)`` of group c)."""
    local = mesh_tensor(mesh)
    table = torch.tensor([list(g) for g in sp_groups], dtype=torch.int64)  # [C, W_sp]
    out = table[:, local]  # [C, T, U, R]
    return out[0] if len(sp_groups) == 1 else out


def _device_mesh(mesh: Mesh, sp_groups: tuple[tuple[int, ...], ...], device_type: str):
    from torch.distributed.device_mesh import DeviceMesh
    key = (mesh, sp_groups, device_type, id(dist.group.WORLD))
    if key not in _MESHES:
        dims = DIMS if len(sp_groups) == 1 else (SP_GROUP_DIM, *DIMS)
        _MESHES[key] = DeviceMesh(device_type, global_mesh_tensor(mesh, sp_groups),
                                  mesh_dim_names=dims)
    return _MESHES[key]


def build_groups(mesh: Mesh, rank: int | None = None, device_type: str | None = None, *,
                 members: Sequence[int] | None = None,
                 sp_groups: Sequence[Sequence[int]] | None = None) -> SPGroups:
    """``SPGroups`` of ``mesh`` for SP rank ``rank`` (default: this process's, i.e. the index
    of its global rank in ``members``). ``members``: global ranks of this SP group in SP-rank
    order (default: the whole default group); ``sp_groups``: every SP group (default: this
    one), the same on every rank."""
    if sp_groups is not None:
        sp_groups = check_sp_groups(sp_groups, sum(len(g) for g in sp_groups))
        sp_groups = None if len(sp_groups) == 1 else sp_groups
    if members is not None and sp_groups is None and tuple(members) == tuple(range(len(members))):
        members = None  # the identity: one SP group, SP rank = global rank
    if rank is None:
        me = dist.get_rank()
        if members is not None and me not in members:
            raise ValueError(f"rank {me} is not in its SP group {tuple(members)}")
        rank = me if members is None else tuple(members).index(me)
    if device_type is None:
        device_type = "cuda" if dist.is_initialized() and dist.get_backend() == "nccl" else "cpu"
    return SPGroups(mesh, rank, device_type, None if members is None else tuple(members),
                    sp_groups)


__all__ = ["DIMS", "SP_GROUP_DIM", "SPGroups", "build_groups", "check_sp_groups",
           "global_mesh_tensor", "mesh_tensor"]
