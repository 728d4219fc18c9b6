"""Input checks and the head-group layouts shared by the strategies.

USP contract (xFuser): ``q, k, v`` are ``[B, H, S, D]`` with rank i of the SP group holding
tokens ``[i*S, (i+1)*S)``; joint (text) tensors are replicated ``[B, H, Tj, D]`` and the
output is ``[B, H, Tj + S, D]`` with the text rows first (``"front"``) or last (``"rear"``).

Head group ``g`` of ``G`` is heads ``[g*h, (g+1)*h)``, ``h = H / G``.

Grouped-query attention: ``k, v`` (and joint ``k, v``) may be ``[B, H_kv, S, D]`` with H_kv
dividing H; query head i uses K/V head ``i // (H / H_kv)``. Query head group g then needs K/V
heads ``[g*h_kv, (g+1)*h_kv)``, ``h_kv = H_kv / G``, when ``G`` divides H_kv: K/V travel with
their own heads (``grouped_kv``), else they are first repeated to ``lcm(H_kv, G)`` heads.

Key-padding mask (``KeyMask``): bool ``[B, L]`` over the sharded sequence (True = attend),
replicated on every rank; the keys of rank p are columns ``[p*S, (p+1)*S)``. Text keys may
have their own ``[B, Tj]`` mask.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import math

import torch

from .. import plan
from ..log import get_logger, log_once

logger = get_logger(__name__)

JOINT_STRATEGIES = ("front", "rear")


class InputError(ValueError):
    """Inputs violate the attention contract; the message names the constraint."""


@dataclass(frozen=True)
class Joint:
    """Replicated text tokens: ``q`` is ``[B, H, Tj, D]``, ``k, v`` ``[B, H_kv, Tj, D]``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    strategy: str

    @property
    def length(self) -> int:
        return self.q.shape[2]

    def head_group(self, g: int, groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views of head group ``g``: queries ``[B, h, Tj, D]``, K/V ``[B, h_kv, Tj, D]``
        (each split into ``groups`` by its own head count)."""
        return tuple(x[:, g * (x.shape[1] // groups):(g + 1) * (x.shape[1] // groups)]
                     for x in (self.q, self.k, self.v))


@dataclass(frozen=True)
class KeyMask:
    """A replicated key-padding mask: ``tokens`` bool ``[B, L]`` over the sharded sequence
    (rank p's keys are columns ``[p*S, (p+1)*S)``), ``text`` bool ``[B, Tj]`` over the joint
    (text) keys or None (every text key attends). True = attend."""

    tokens: torch.Tensor | None
    S: int
    text: torch.Tensor | None = None

    def chunk(self, rank: int) -> torch.Tensor | None:
        """``[B, S]`` view: the mask of the keys rank ``rank`` holds (None: no token mask)."""
        return None if self.tokens is None else self.tokens[:, rank * self.S:(rank + 1) * self.S]


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int,
                 ulysses_degree: int, joint_query: torch.Tensor | None = None,
                 joint_key: torch.Tensor | None = None, joint_value: torch.Tensor | None = None,
                 joint_strategy: str | None = None) -> Joint | None:
    """Validate the USP contract; return the joint tokens (or None)."""
    for name, x in (("query", q), ("key", k), ("value", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise InputError(f"{name} must be a 4-D tensor [B, H, S_local, D], got "
                             f"{getattr(x, 'shape', type(x).__name__)}")
    if (k.shape != v.shape or (k.shape[0], k.shape[2], k.shape[3]) != (q.shape[0], q.shape[2], q.shape[3])
            or k.shape[1] == 0 or q.shape[1] % k.shape[1]):
        raise InputError(f"query/key/value shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)} "
                         "do not fit: query is [B, H, S_local, D] and key/value [B, H_kv, S_local, D] "
                         "with the same B, S_local, D and H_kv dividing H (grouped-query attention: "
                         "query head i uses K/V head i // (H / H_kv))")
    if not (q.dtype == k.dtype == v.dtype):
        raise InputError(f"query/key/value dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise InputError(f"query/key/value devices differ: {q.device}, {k.device}, {v.device}")
    if not q.dtype.is_floating_point:
        raise InputError(f"attention needs floating-point inputs, got {q.dtype}")
    B, H, S, D = q.shape
    Hkv = k.shape[1]
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
    for name, x, heads in (("joint_query", joint_query, H), ("joint_key", joint_key, Hkv),
                           ("joint_value", joint_value, Hkv)):
        if x.dim() != 4 or x.shape[0] != B or x.shape[1] != heads or x.shape[3] != D:
            raise InputError(f"{name} must be [B={B}, {heads} heads (as {name.split('_')[1]}), T, D={D}] "
                             f"(replicated on every rank), got {tuple(x.shape)}")
        if x.dtype != q.dtype or x.device != q.device:
            raise InputError(f"{name} is {x.dtype} on {x.device}; query is {q.dtype} on {q.device}")
    if not (joint_query.shape[2] == joint_key.shape[2] and joint_key.shape == joint_value.shape):
        raise InputError(f"joint tensor shapes differ: {tuple(joint_query.shape)}, "
                         f"{tuple(joint_key.shape)}, {tuple(joint_value.shape)}")
    return Joint(joint_query, joint_key, joint_value, joint_strategy)


def check_key_mask(key_mask: torch.Tensor | None, joint_key_mask: torch.Tensor | None,
                   q: torch.Tensor, world: int, joint: Joint | None) -> KeyMask | None:
    """The key masks of a call as a ``KeyMask`` (None: no mask). ``key_mask``: bool
    ``[B, L]`` or xFuser's ``[B, 1, 1, L]``, ``L = world * S_local`` (the sharded sequence);
    ``joint_key_mask``: bool ``[B, Tj]`` (or ``[B, 1, 1, Tj]``) over the text keys."""
    if key_mask is None and joint_key_mask is None:
        return None
    B, _, S, _ = q.shape

    def canon(m: torch.Tensor, L: int, name: str, what: str) -> torch.Tensor:
        if not isinstance(m, torch.Tensor) or m.dtype != torch.bool:
            raise InputError(f"{name} must be a bool tensor (True = attend), got "
                             f"{getattr(m, 'dtype', type(m).__name__)}; additive float masks are "
                             "not supported")
        if m.dim() == 4 and m.shape[1:3] == (1, 1):
            m = m[:, 0, 0]  # [B, 1, 1, L] -> [B, L]
        if tuple(m.shape) != (B, L):
            raise InputError(f"{name} must be [B={B}, L={L}] ({what}) or [B, 1, 1, L], got "
                             f"{tuple(m.shape)}")
        if m.device != q.device:
            raise InputError(f"{name} is on {m.device}; query is on {q.device}")
        return m

    tokens = None if key_mask is None else canon(
        key_mask, world * S, "key_mask", f"the sharded sequence: {world} ranks x S_local={S}")
    text = None
    if joint_key_mask is not None:
        if joint is None:
            raise InputError("joint_key_mask needs joint (text) tensors")
        text = canon(joint_key_mask, joint.length, "joint_key_mask", "the joint text keys")
    return KeyMask(tokens, S, text)


def kv_heads_for(heads: int, heads_kv: int, groups: int) -> int:
    """The fewest K/V heads, a multiple of ``heads_kv``, that split into ``groups`` head
    groups matching the query head groups: ``lcm(heads_kv, groups)`` (it divides ``heads``,
    which both divide)."""
    return math.lcm(heads_kv, groups)


def grouped_kv(k: torch.Tensor, v: torch.Tensor, joint: Joint | None, heads: int, groups: int,
               who: str) -> tuple[torch.Tensor, torch.Tensor, Joint | None]:
    """``(k, v, joint)`` whose K/V heads split into ``groups`` query head groups: unchanged
    when ``groups`` divides H_kv, else K/V (and the text K/V) repeated to
    ``kv_heads_for(...)`` heads, logged once with the cost."""
    Hkv = k.shape[1]
    want = kv_heads_for(heads, Hkv, groups)
    if want == Hkv:
        return k, v, joint
    f = want // Hkv
    log_once(logger, f"gqa-expand-{who}-{heads}-{Hkv}-{groups}",
             f"{who}: {Hkv} K/V heads do not split into {groups} head groups; K/V repeated to "
             f"{want} heads before the exchange ({f}x the K/V bytes of {Hkv} heads, "
             f"{want}/{heads} of full multi-head K/V); a head-group count dividing {Hkv} "
             "moves them unexpanded")
    if joint is not None:
        joint = Joint(joint.q, repeat_heads(joint.k, f), repeat_heads(joint.v, f), joint.strategy)
    return repeat_heads(k, f), repeat_heads(v, f), joint


def repeat_heads(x: torch.Tensor, f: int) -> torch.Tensor:
    """``[B, H_kv, L, D] -> [B, H_kv * f, L, D]``, head i reading head ``i // f`` (as
    ``repeat_interleave(f, dim=1)``), into a new tensor written by a plan's step."""
    B, Hkv, L, D = x.shape
    out = torch.empty(B, Hkv * f, L, D, dtype=x.dtype, device=x.device)
    # [B, H_kv * f, L, D] viewed as [B, H_kv, f, L, D] <- [B, H_kv, 1, L, D] expanded
    plan.call(lambda: out.view(B, Hkv, f, L, D).copy_(x[:, :, None].expand(B, Hkv, f, L, D)))
    return out


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
