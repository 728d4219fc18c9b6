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

from .. import plan
from ..log import get_logger, log_once
from .layout import Joint, KeyMask, repeat_heads
from .planned import PlanCache
from .registry import BuildArgs, Strategy, StrategySpec

logger = get_logger(__name__)


def padding_message(heads: int, padded: int, topology: object, spec: str) -> str:
    """The once-per-configuration note of a padded run (its cost and how to avoid it)."""
    return (f"{spec}: padding {heads} heads to {padded} so the Torus schedule runs on {topology} "
            f"({padded / heads:.3g}x attention compute and inter-machine bytes); pass "
            "ulysses_degree/ring_degree to choose the mesh yourself, or options={'pad_heads': "
            "False} to run the fallback instead")


def _pad(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``[B, h, L, D]`` -> a new ``[B, heads, L, D]``: zero heads appended (zeroed once; a plan's
    step copies ``x`` into the first ``h``)."""
    B, h, L, D = x.shape
    out = torch.empty(B, heads, L, D, dtype=x.dtype, device=x.device)
    with plan.preparing():
        out[:, h:].zero_()
    plan.call(lambda: out[:, :h].copy_(x))
    return out


class PaddedAttention:
    """``inner`` (built for ``padded`` heads) on inputs with ``heads`` query heads, under the
    USP contract: ``[B, H, S_local, D]`` in (K/V may be ``[B, H_kv, S_local, D]``), text as
    ``joint``, ``[B, H, Tj + S_local, D]`` out (a view of the padded output's first ``H``
    heads). A ``key_mask`` (per token, head-independent) passes through unchanged. Runs as
    execution plans (``planned.py``) into which the inner strategy's calls are inlined.
    ``spec``, ``comms`` and ``close`` are ``inner``'s: the strategy that runs is the one asked,
    and its byte counters count the padded heads it moves. ``options``: the ones ``inner`` was
    built with (its ``cuda_graphs`` option governs the plans, which hold ``inner``'s calls)."""

    def __init__(self, inner: Strategy, heads: int, padded: int, options: dict | None = None) -> None:
        if padded <= heads:
            raise ValueError(f"padded head count {padded} must exceed the {heads} heads")
        self.inner, self.heads, self.padded = inner, heads, padded
        self.spec: StrategySpec = inner.spec
        self.plans = PlanCache.for_strategy(self, options)

    @property
    def comms(self) -> list:
        return self.inner.comms

    def plan_children(self) -> list:
        return [self.inner]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 joint: Joint | None, scale: float, key_mask: KeyMask | None = None) -> torch.Tensor:
        if q.shape[1] != self.heads:
            raise ValueError(f"{self.spec.name}: query has {q.shape[1]} heads, the padded strategy "
                             f"was built for {self.heads} (padded to {self.padded})")
        return self.plans(q, k, v, joint, scale, key_mask)

    def layer(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              joint: Joint | None, scale: float, key_mask: KeyMask | None = None) -> torch.Tensor:
        """One layer's calls (what a plan records; the inner strategy's are inlined)."""
        H, Hkv, Hp = q.shape[1], k.shape[1], self.padded
        if Hkv != H:
            rep = H // Hkv
            log_once(logger, f"padded-gqa-{self.spec.name}-{H}-{Hkv}-{Hp}",
                     f"{self.spec.name}: K/V repeated from {Hkv} to {H} heads before padding to "
                     f"{Hp} ({Hp / Hkv:.3g}x the K/V bytes)")
            k, v = repeat_heads(k, rep), repeat_heads(v, rep)
            if joint is not None:
                joint = replace(joint, k=repeat_heads(joint.k, rep), v=repeat_heads(joint.v, rep))
        if joint is not None:
            joint = replace(joint, q=_pad(joint.q, Hp), k=_pad(joint.k, Hp), v=_pad(joint.v, Hp))
        kwargs = {} if key_mask is None else {"key_mask": key_mask}
        args = (_pad(q, Hp), _pad(k, Hp), _pad(v, Hp), joint, scale)
        if not isinstance(getattr(self.inner, "plans", None), PlanCache):  # runs as a whole step
            return plan.output(lambda: self.inner(*args, **kwargs)[:, :H])
        out = self.inner(*args, **kwargs)  # its calls, inlined
        return plan.then(out, lambda o: o[:, :H])  # [B, H', Tj + S, D] -> [B, H, Tj + S, D]

    def close(self, failed: bool) -> None:
        self.inner.close(failed)


def build_padded(spec: StrategySpec, args: BuildArgs, padded: int) -> PaddedAttention:
    """``spec`` built for ``padded`` heads on ``args.mesh`` (the padded head count's mesh),
    wrapped to take ``args.num_heads`` heads (collective, as ``spec.build``)."""
    inner = spec.build(replace(args, num_heads=padded))
    return PaddedAttention(inner, args.num_heads, padded, args.options)


__all__ = ["PaddedAttention", "build_padded", "padding_message"]
