"""Input checks and the head-group layouts shared by the strategies.

USP contract (xFuser): ``q, k, v`` are ``[B, H, S, D]`` with rank i of the SP group holding
tokens ``[i*S, (i+1)*S)``; joint (text) tensors are replicated ``[B, H, Tj, D]`` and the
output is ``[B, H, Tj + S, D]`` with the text rows first (``"front"``) or last (``"rear"``).

Head group ``g`` of ``G`` is heads ``[g*h, (g+1)*h)``, ``h = H / G``.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

JOINT_STRATEGIES = ("front", "rear")


class InputError(ValueError):
    """Inputs violate the attention contract; the message names the constraint."""


@dataclass(frozen=True)
class Joint:
    """Replicated text tokens: ``q, k, v`` are ``[B, H, Tj, D]``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    strategy: str

    @property
    def length(self) -> int:
        return self.q.shape[2]

    def head_group(self, g: int, groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views ``[B, h, Tj, D]`` of head group ``g``."""
        h = self.q.shape[1] // groups
        return tuple(x[:, g * h:(g + 1) * h] for x in (self.q, self.k, self.v))


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int,
                 ulysses_degree: int, joint_query: torch.Tensor | None = None,
                 joint_key: torch.Tensor | None = None, joint_value: torch.Tensor | None = None,
                 joint_strategy: str | None = None) -> Joint | None:
    """Validate the USP contract; return the joint tokens (or None)."""
    for name, x in (("query", q), ("key", k), ("value", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise InputError(f"{name} must be a 4-D tensor [B, H, S_local, D], got "
                             f"{getattr(x, 'shape', type(x).__name__)}")
    if not (q.shape == k.shape == v.shape):
        raise InputError(f"query/key/value shapes differ: {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}; all must be [B, H, S_local, D] with the same sizes "
                         "(GQA is not supported by this strategy: repeat K/V heads first)")
    if not (q.dtype == k.dtype == v.dtype):
        raise InputError(f"query/key/value dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise InputError(f"query/key/value devices differ: {q.device}, {k.device}, {v.device}")
    if not q.dtype.is_floating_point:
        raise InputError(f"attention needs floating-point inputs, got {q.dtype}")
    B, H, S, D = q.shape
    if H != num_heads:
        raise InputError(f"query has {H} heads but the context was initialised with "
                         f"num_heads={num_heads}; pass the model's head count to init_sequence_parallel")
    if H % ulysses_degree:
        raise InputError(f"{H} heads are not divisible by the ulysses degree {ulysses_degree}")
    if S == 0:
        raise InputError("local sequence length is 0; every rank needs at least one token")
    given = [x is not None for x in (joint_query, joint_key, joint_value)]
    if not any(given) and joint_strategy is None:
        return None
    if not all(given) or joint_strategy is None:
        raise InputError("joint attention needs joint_query, joint_key, joint_value and "
                         "joint_strategy together (got "
                         f"{['joint_query', 'joint_key', 'joint_value'][given.index(False)] if not all(given) else 'joint_strategy=None'} missing)")
    if joint_strategy not in JOINT_STRATEGIES:
        raise InputError(f"joint_strategy must be one of {JOINT_STRATEGIES}, got {joint_strategy!r}")
    for name, x in (("joint_query", joint_query), ("joint_key", joint_key), ("joint_value", joint_value)):
        if x.dim() != 4 or x.shape[0] != B or x.shape[1] != H or x.shape[3] != D:
            raise InputError(f"{name} must be [B={B}, H={H}, T, D={D}] (replicated on every rank), "
                             f"got {tuple(x.shape)}")
        if x.dtype != q.dtype or x.device != q.device:
            raise InputError(f"{name} is {x.dtype} on {x.device}; query is {q.dtype} on {q.device}")
    if not (joint_query.shape == joint_key.shape == joint_value.shape):
        raise InputError(f"joint tensor shapes differ: {tuple(joint_query.shape)}, "
                         f"{tuple(joint_key.shape)}, {tuple(joint_value.shape)}")
    return Joint(joint_query, joint_key, joint_value, joint_strategy)


def split_heads(x: torch.Tensor, *groups: int) -> torch.Tensor:
    """``[B, H, S, D] -> [*groups, B, h, S, D]`` view, ``h = H / prod(groups)``."""
    B, H, S, D = x.shape
    n = len(groups)
    # [B, H, S, D] -> [B, *groups, h, S, D] -> [*groups, B, h, S, D]
    y = x.view(B, *groups, -1, S, D)
    return y.permute(*range(1, n + 1), 0, n + 1, n + 2, n + 3)


@dataclass(frozen=True)
class Slots:
    """A grid ``[*groups]`` of slots, each ONE contiguous run holding the ``[B, h, S, D]``
    image rows of one head group and then its ``[B, h, Tj, D]`` text rows.

    A slot moves in one transfer, and its image rows alone are a contiguous prefix, so a
    query block ``[B, h, S, D]`` can live in the slot its own output overwrites later.
    """

    flat: torch.Tensor  # [*groups, B*h*(S+Tj)*D]
    rows: torch.Tensor  # [*groups, B, h, S, D] view of the prefix of every slot
    text: torch.Tensor  # [*groups, B, h, Tj, D] view of the rest

    @staticmethod
    def numel(B: int, h: int, S: int, Tj: int, D: int) -> int:
        """Elements of one slot."""
        return B * h * (S + Tj) * D

    @classmethod
    def view(cls, flat: torch.Tensor, B: int, h: int, S: int, Tj: int, D: int) -> "Slots":
        """Slots over ``flat`` ``[*groups, numel(B, h, S, Tj, D)]`` (no copy)."""
        *groups, n = flat.shape
        if n != cls.numel(B, h, S, Tj, D):
            raise ValueError(f"slot of {n} elements cannot hold [B={B}, h={h}, S+Tj={S}+{Tj}, D={D}]")
        m = B * h * S * D
        # [*groups, B*h*(S+Tj)*D] -> [*groups, B, h, S, D] and [*groups, B, h, Tj, D]
        return cls(flat, flat[..., :m].view(*groups, B, h, S, D), flat[..., m:].view(*groups, B, h, Tj, D))

    @classmethod
    def alloc(cls, empty: Callable[[tuple[int, ...]], torch.Tensor], groups: tuple[int, ...],
              B: int, h: int, S: int, Tj: int, D: int) -> "Slots":
        """Slots in a new buffer ``empty(shape)`` (``Tensor.new_empty``, a symmetric allocator)."""
        return cls.view(empty((*groups, cls.numel(B, h, S, Tj, D))), B, h, S, Tj, D)


def gather_output(o: Slots, joint: Joint | None) -> torch.Tensor:
    """Slots of ``[*groups]`` head groups -> ``[B, H, S (+ Tj), D]``, the text rows first or
    last as ``joint.strategy`` says (USP's output layout).

    Always a new tensor, written once: callers may keep it while ``o`` (often a buffer the
    next call rewrites) changes.
    """
    n = o.rows.dim() - 4
    B, h, S, D = o.rows.shape[n:]
    Tj = o.text.shape[-2]
    out = torch.empty(B, *o.rows.shape[:n], h, S + Tj, D, dtype=o.flat.dtype, device=o.flat.device)
    front = joint is not None and joint.strategy == "front"
    img, txt = (slice(Tj, None), slice(0, Tj)) if front else (slice(0, S), slice(S, None))
    to_batch_first = (n, *range(n), n + 1, n + 2, n + 3)  # [*groups, B, h, L, D] -> [B, *groups, h, L, D]
    out[..., img, :] = o.rows.permute(to_batch_first)
    if Tj:
        out[..., txt, :] = o.text.permute(to_batch_first)
    return out.view(B, -1, S + Tj, D)  # [B, *groups, h, S + Tj, D] -> [B, H, S + Tj, D]
