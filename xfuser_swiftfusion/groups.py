"""The mesh as process groups: the one place where a placement becomes ranks and groups.

A ``Mesh`` (``mesh.py``) says which global rank is GPU ``(t, u, r)``; ``SPGroups`` lays those
ranks out as a ``torch.distributed.device_mesh.DeviceMesh`` with named dimensions
``("torus", "ulysses", "ring")`` (``[T, U, R]``; a mesh whose Ulysses group does not split
into ``T`` machines x ``U`` GPUs is ``[1, P_u, R]``). Everything else derives from it:

- rank tuples for the transports (``ulysses_ranks``, ``ring_ranks``, ``ring_groups``: the
  two-sided exchanges and the NVSHMEM teams of the one-sided one);
- ``ProcessGroup`` objects (``ulysses_group``: the flattened torus x ulysses dimension,
  ``ring_group``), which xFuser / yunchang are given instead of building their own.

Building the ``DeviceMesh`` is collective over the default group; it is built once per
(mesh, device type, default group) and process, on first use of a process group.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.distributed as dist

from .mesh import Mesh

DIMS = ("torus", "ulysses", "ring")


def mesh_tensor(mesh: Mesh) -> torch.Tensor:
    """Global ranks ``[T, U, R]`` of ``mesh`` (``[1, P_u, R]`` where the Ulysses group does
    not factor into whole machines); entry ``[t, u, r]`` is GPU ``(t, u, r)``."""
    T, U = mesh.torus, mesh.ulysses_intra
    if T * U != mesh.ulysses:
        T, U = 1, mesh.ulysses
    ranks = [[[mesh.rank_of_g(t * U + u, r) for r in range(mesh.ring)] for u in range(U)]
             for t in range(T)]
    return torch.tensor(ranks, dtype=torch.int64)


@dataclass(eq=False)
class SPGroups:
    """Groups of one sequence-parallel mesh as seen from ``rank``."""

    mesh: Mesh
    rank: int
    device_type: str = "cpu"
    _device_mesh: object = field(default=None, init=False, repr=False)

    @cached_property
    def ranks(self) -> torch.Tensor:
        """``[T, U, R]`` global ranks (see ``mesh_tensor``)."""
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
        """This rank's Ulysses group."""
        return next(g for g in self.ulysses_groups if self.rank in g)

    @property
    def ring_ranks(self) -> tuple[int, ...]:
        """This rank's Ring group."""
        return next(g for g in self.ring_groups if self.rank in g)

    @property
    def device_mesh(self):
        """The ``DeviceMesh`` (collective on first access: every rank must ask)."""
        if self._device_mesh is None:
            self._device_mesh = _device_mesh(self.mesh, self.device_type)
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


def _device_mesh(mesh: Mesh, device_type: str):
    from torch.distributed.device_mesh import DeviceMesh
    key = (mesh, device_type, id(dist.group.WORLD))
    if key not in _MESHES:
        _MESHES[key] = DeviceMesh(device_type, mesh_tensor(mesh), mesh_dim_names=DIMS)
    return _MESHES[key]


def build_groups(mesh: Mesh, rank: int | None = None, device_type: str | None = None) -> SPGroups:
    """``SPGroups`` of ``mesh`` for ``rank`` (default: this process's rank)."""
    if rank is None:
        rank = dist.get_rank()
    if device_type is None:
        device_type = "cuda" if dist.is_initialized() and dist.get_backend() == "nccl" else "cpu"
    return SPGroups(mesh, rank, device_type)


__all__ = ["DIMS", "SPGroups", "build_groups", "mesh_tensor"]
