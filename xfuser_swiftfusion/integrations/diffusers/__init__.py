"""diffusers integration: diffusers' own context parallelism with a SwiftFusion strategy.

    from xfuser_swiftfusion.integrations import diffusers as sfd
    ctx = sfd.enable_parallelism(pipe.transformer, strategy="swiftfusion")  # every rank
    pipe(...)                                  # the same call as on one device
    sfd.disable_parallelism(pipe.transformer)  # diffusers' attention again; ctx closed

Every diffusers model with a ``_cp_plan`` (Flux, FLUX.2, Wan, Qwen-Image, LTX, LTX-2,
MiniMax-H3, Helios, ChronoEdit in diffusers 0.42) works: diffusers' hooks split the sequence
over the default process group (rank i: the i-th contiguous chunk) and gather the output;
the attention of every context-parallel call runs on the strategy (``tas``, ``torus``,
``swiftfusion``, ``auto``) with the topology-aware mesh. Text sharded with the image (Flux,
FLUX.2, Qwen-Image, MiniMax-H3) is simply more sequence; LTX's sharded text meets the video
queries in a masked cross-attention (the all-gathered path); the replicated text of Wan-like
models is read by cross-attention that diffusers runs without context parallelism.

Modules (importing this package imports no diffusers and changes nothing):
- ``parallel``: ``enable_parallelism`` / ``disable_parallelism`` / ``context_of``;
- ``routing``: diffusers' attention backends routed to a context, and the calls that run
  diffusers' attention on all-gathered keys/values instead (masks, cross-attention lengths);
- ``sharding``: the rank-order mesh given to diffusers, its uneven-length error, and turning
  diffusers' context parallelism off again;
- ``plans``: the ``_cp_plan`` used, with a fix for LTX-2's (``cross_attn_rope`` unsplit).

Not supported: causal attention (``UnsupportedAttention``), backward passes (inference only),
uneven chunks (diffusers' ``ulysses_anything`` / ``ring_anything``: a ``ValueError`` names
the inputs). ``auto`` may pick ``usp``, which runs xFuser's USP on xFuser's groups.
"""
from __future__ import annotations

from .parallel import context_of, disable_parallelism, enable_parallelism
from .routing import UnsupportedAttention

__all__ = ["UnsupportedAttention", "context_of", "disable_parallelism", "enable_parallelism"]
