"""Zero-padded heads: a strategy run on ``H' > H`` heads so that its mesh fits the machines.

The Torus schedule (``torus``, ``swiftfusion``) needs every ring group inside one machine;
the default mesh ``P_u = gcd(N*M, H)`` has that only when ``N`` divides ``H`` (e.g. Wan 14B's
40 heads on 3 x 8 GPUs give U8 x R3, whose ring groups cross machines). ``mesh.torus_padding``
picks ``H'``; ``PaddedAttention`` runs the strategy built for ``H'`` heads:

    q, k, v [B, H, S, D] -> zero heads appended -> [B, H', S, D] -> strategy
    -> out [B, H', Tj + S, D] -> out[:, :H] = [B, H, Tj + S, D]

Invariant: heads ``H .. H'-1`` have zero queries and zero keys, so every score is 0 and the
softmax is uniform over their keys (the unmasked ones under a key mask; a row with none left
outputs 0), and their values are zero: their output is 0 and is discarded. Heads never mix,
so heads ``0 .. H-1`` are exactly the unpadded attention. Cost: ``H'/H`` times the attention
compute and the bytes moved (inter-machine included), plus one copy of Q, K, V on the way in.

Grouped-query K/V (``[B, H_kv, S, D]``) are first repeated to the ``H`` query heads (query
head i reads K/V head ``i // (H / H_kv)``), then padded: ``H' / H_kv`` times the K/V bytes.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from ..log import get_logger, log_once
from .layout import Joint
from .registry import BuildArgs, Strategy, StrategySpec

logger = get_logger(__name__)


def padding_message(heads: int, padded: int, topology: object, spec: str) -> str:
    """The once-per-configuration note of a padded run (its cost and how to avoid it)."""
    return (f"{spec}: padding {heads} heads to {padded} so the Torus schedule runs on {topology} "
            f"({padded / heads:.3g}x attention compute and inter-machine bytes); pass "
            "ulysses_degree/ring_degree to choose the mesh yourself, or options={'pad_heads': "
            "False} to run the fallback instead")


def _pad(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``[B, h, L, D]`` -> ``[B, heads, L, D]``: zero heads appended."""
    B, h, L, D = x.shape
    return torch.cat([x, x.new_zeros(B, heads - h, L, D)], dim=1)  # [B, heads, L, D]


def _repeat(x: torch.Tensor, rep: int) -> torch.Tensor:
    """``[B, H_kv, L, D]`` -> ``[B, H_kv * rep, L, D]``: head i reads head ``i // rep``."""
    return x.repeat_interleave(rep, dim=1)  # [B, H_kv, L, D] -> [B, H, L, D]


class PaddedAttention:
    """``inner`` (built for ``padded`` heads) on inputs with ``heads`` query heads, under the
    USP contract: ``[B, H, S_local, D]`` in (K/V may be ``[B, H_kv, S_local, D]``), text as
    ``joint``, ``[B, H, Tj + S_local, D]`` out (a view of the padded output's first ``H``
    heads). Keyword arguments (e.g. ``key_mask=``, per-token, head-independent) pass through
    unchanged. ``spec``, ``comms`` and ``close`` are ``inner``'s: the strategy that runs is the
    one asked, and its byte counters count the padded heads it moves."""

    def __init__(self, inner: Strategy, heads: int, padded: int) -> None:
        if padded <= heads:
            raise ValueError(f"padded head count {padded} must exceed the {heads} heads")
        self.inner, self.heads, self.padded = inner, heads, padded
        self.spec: StrategySpec = inner.spec

    @property
    def comms(self) -> list:
        return self.inner.comms

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 joint: Joint | None, scale: float, **kwargs) -> torch.Tensor:
        H, Hkv, Hp = q.shape[1], k.shape[1], self.padded
        if H != self.heads:
            raise ValueError(f"{self.spec.name}: query has {H} heads, the padded strategy was "
                             f"built for {self.heads} (padded to {Hp})")
        if Hkv != H:
            rep = H // Hkv
            log_once(logger, f"padded-gqa-{self.spec.name}-{H}-{Hkv}-{Hp}",
                     f"{self.spec.name}: K/V repeated from {Hkv} to {H} heads before padding to "
                     f"{Hp} ({Hp / Hkv:.3g}x the K/V bytes)")
            k, v = _repeat(k, rep), _repeat(v, rep)
            if joint is not None:
                joint = replace(joint, k=_repeat(joint.k, rep), v=_repeat(joint.v, rep))
        if joint is not None:
            joint = replace(joint, q=_pad(joint.q, Hp), k=_pad(joint.k, Hp), v=_pad(joint.v, Hp))
        out = self.inner(_pad(q, Hp), _pad(k, Hp), _pad(v, Hp), joint, scale, **kwargs)
        return out[:, :H]  # [B, H', Tj + S, D] -> [B, H, Tj + S, D]

    def close(self, failed: bool) -> None:
        self.inner.close(failed)


def build_padded(spec: StrategySpec, args: BuildArgs, padded: int) -> PaddedAttention:
    """``spec`` built for ``padded`` heads on ``args.mesh`` (the padded head count's mesh),
    wrapped to take ``args.num_heads`` heads (collective, as ``spec.build``)."""
    inner = spec.build(replace(args, num_heads=padded))
    return PaddedAttention(inner, args.num_heads, padded)


__all__ = ["PaddedAttention", "build_padded", "padding_message"]
