"""One SP group's view of a one-sided communicator over the whole default group.

With several SP groups (xFuser's CFG parallelism: one per CFG half) every rank holds ONE
one-sided communicator over the default group (NVSHMEM: one instance per process, its
symmetric heap spans every PE; ``shm``: one heap per host), and each SP group addresses its own
members through a ``SubgroupOneSided``: its ranks are SP ranks (``members[i]`` is SP rank
``i``'s global rank), ``put``/``get`` go to global peers, ``barrier_all`` is a barrier over the
SP group only, ``barrier``/``sync`` translate their ranks, and ``prepare_groups`` declares the
translated groups of every SP group (the same list on every rank: it is collective over the
world, as NVSHMEM's team split is).

What stays collective over the world: creating the communicator, ``symmetric_empty`` (NVSHMEM
allocates on every PE) and ``close`` (NVSHMEM frees and finalizes collectively). The strategies
allocate on the first call with a new input shape, so the SP groups must make the same
attention calls in the same order, as CFG halves do (same model, same shapes). Each of these
steps starts with a bounded rendezvous over the world (``world_rendezvous``): a group that does
not join within ``timeout_s`` raises ``CommTimeout`` naming the step, and groups asking for
different buffers raise ``ValueError`` naming each group's request, instead of a hang or, on
NVSHMEM, mismatched allocations.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from .base import CommTimeout, Handle, OneSided, PeerFailure

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int64, torch.int32,
           torch.uint8, torch.int8)
_MAX_DIMS = 12


def world_rendezvous(values: Sequence[int], *, rank: int, what: str, timeout_s: float) -> list[list[int]]:
    """Collective over the default group: every rank's ``values`` (at most ``_MAX_DIMS + 2``
    integers), gathered within ``timeout_s`` (``CommTimeout`` naming ``what`` otherwise)."""
    n = _MAX_DIMS + 3
    if len(values) > n - 1:
        raise ValueError(f"{what}: at most {n - 1} values, got {len(values)}")
    device = (torch.device("cuda", torch.cuda.current_device())
              if dist.get_backend() == "nccl" else torch.device("cpu"))
    mine = torch.full((n,), -1, dtype=torch.int64, device=device)
    mine[0] = len(values)
    if values:
        mine[1:1 + len(values)] = torch.tensor(list(values), dtype=torch.int64)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    work = dist.all_gather(rows, mine, async_op=True)
    try:
        work.wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        doing = f"rank {rank}: {what!r} (collective over every SP group)"
        if "timed out" not in str(exc).lower():
            raise PeerFailure(f"{doing}: all-gather failed: {exc}") from exc
        raise CommTimeout(f"{doing}: the other ranks did not join within {timeout_s:.1f} s; every "
                          "SP group must make the same attention calls, with the same shapes, in "
                          "the same order (symmetric buffers are allocated over all ranks)") from exc
    return [r[1:1 + int(r[0])].tolist() for r in (row.cpu() for row in rows)]


def _check_same(rows: list[list[int]], sp_groups: Sequence[Sequence[int]], what: str,
                show: Callable[[list[int]], str]) -> None:
    """``ValueError`` naming each SP group's request unless every rank asked for the same."""
    if len({tuple(r) for r in rows}) > 1:
        asks = "; ".join(f"SP group {list(g)} asks {show(rows[g[0]])}" for g in sp_groups)
        raise ValueError(f"{what}: the SP groups disagree ({asks}); symmetric buffers are "
                         "allocated over all ranks, so every SP group must make the same "
                         "attention calls, with the same shapes, in the same order")


def _show_buffer(row: list[int]) -> str:
    dtype = _DTYPES[row[0]] if 0 <= row[0] < len(_DTYPES) else "other dtype"
    return f"{tuple(row[1:])} {dtype}"


class SubgroupOneSided(OneSided):
    """The one-sided contract over SP ranks ``0 .. len(members) - 1``, on ``inner``, a
    communicator over the whole default group (global ranks). See the module docstring."""

    def __init__(self, inner: OneSided, members: Sequence[int],
                 sp_groups: Sequence[Sequence[int]]) -> None:
        members = tuple(members)
        if inner.rank not in members:
            raise ValueError(f"rank {inner.rank} is not in its SP group {members}")
        self.inner = inner
        self.members = members
        self.sp_groups = tuple(tuple(g) for g in sp_groups)
        super().__init__(members.index(inner.rank), len(members),
                         [inner.node_of[x] for x in members], inner.timeout_s)
        self.counter = inner.counter  # bytes by the world communicator's machines (the same)
        self._buffers = inner._buffers
        self._allocations = 0
        # NVSHMEM: one team per SP group, for barrier_all (collective: every group, one order)
        self.inner.prepare_groups(self.sp_groups)

    @property
    def failed(self) -> bool:  # type: ignore[override]
        return self.inner.failed

    @failed.setter
    def failed(self, value: bool) -> None:
        self.inner.failed = value

    def _peer(self, peer: int, what: str) -> int:
        if not 0 <= peer < self.world_size:
            raise ValueError(f"rank {self.inner.rank} (SP rank {self.rank}): {what!r}: peer "
                             f"{peer} out of range for the {self.world_size} ranks of the SP group")
        return self.members[peer]

    def _global(self, ranks: tuple[int, ...], what: str) -> tuple[int, ...]:
        return tuple(self._peer(x, what) for x in ranks)

    def symmetric_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Collective over the world (every SP group allocates the same buffer)."""
        what = f"symmetric allocation {self._allocations} {tuple(shape)} {dtype}"
        code = _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES)
        if len(shape) > _MAX_DIMS:
            raise ValueError(f"{what}: at most {_MAX_DIMS} dimensions")
        rows = world_rendezvous([code, *shape], rank=self.inner.rank, what=what,
                                timeout_s=self.timeout_s)
        _check_same(rows, self.sp_groups, what, _show_buffer)
        self._allocations += 1
        return self.inner.symmetric_empty(shape, dtype)

    def prepare(self, op: str, dst: torch.Tensor, src: torch.Tensor, peer: int, *, queue: str,
                what: str) -> Callable[[], Handle]:
        return self.inner.prepare(op, dst, src, self._peer(peer, what), queue=queue, what=what)

    def prepare_barrier(self, ranks: tuple[int, ...] | None, *, what: str,
                        quiet: bool = True) -> Callable[[], None]:
        """``barrier_all`` is a barrier over the SP group (not the other SP groups)."""
        ranks = self.members if ranks is None else self._global(ranks, what)
        return self.inner.prepare_barrier(ranks, what=what, quiet=quiet)

    def capturing(self):
        return self.inner.capturing()

    def watch(self, event, what: str) -> None:
        self.inner.watch(event, what)

    def prepare_groups(self, groups: Sequence[tuple[int, ...]]) -> None:
        """Collective over the world: ``groups`` (SP ranks, the same in every SP group)
        translated into every SP group, in one order on every rank."""
        self.inner.prepare_groups([tuple(g[x] for x in grp) for g in self.sp_groups
                                   for grp in groups])

    def symmetric_heap_bytes(self) -> int:
        return self.inner.symmetric_heap_bytes()

    def close(self) -> None:
        """Close the world communicator (collective on NVSHMEM unless ``failed``)."""
        self.inner.close()


def make_subgroup_one_sided(make_inner: Callable[[], OneSided], *, rank: int, members: Sequence[int],
                            sp_groups: Sequence[Sequence[int]], timeout_s: float) -> SubgroupOneSided:
    """Collective over the world: a bounded rendezvous, then ``make_inner()`` (the world
    communicator) wrapped for the SP group ``members``."""
    rows = world_rendezvous([len(members)], rank=rank, what="one-sided communicator creation",
                            timeout_s=timeout_s)
    _check_same(rows, sp_groups, "one-sided communicator creation", lambda r: f"{r[0]} ranks")
    return SubgroupOneSided(make_inner(), members, sp_groups)


__all__ = ["SubgroupOneSided", "make_subgroup_one_sided", "world_rendezvous"]
