"""diffusers integration: diffusers' own context parallelism with a SwiftFusion strategy.

    from xfuser_swiftfusion.integrations import diffusers as sfd
    ctx = sfd.enable_parallelism(pipe.transformer, strategy="swiftfusion")  # every rank
    pipe(...)                                  # the same call as on one device
    sfd.disable_parallelism(pipe.transformer)  # diffusers' attention again; ctx closed

Every diffusers model with a ``_cp_plan`` (Flux, FLUX.2, Wan, Qwen-Image, LTX, LTX-2,
MiniMax-H3, Helios, ChronoEdit in diffusers 0.42) works: diffusers' hooks split the sequence
over the default process group (rank i: the i-th contiguous chunk) and gather the output;
a plan naming more blocks than the model has is trimmed to it (``plans``). Each attention
call takes the path its tokens call for (``routing``; ``attention_paths(model)`` counts them):

- sharded queries and keys/values of one length (every self-attention; text sharded with
  the image in Flux, FLUX.2, Qwen-Image, MiniMax-H3 is simply more sequence) run on the
  strategy (``tas``, ``torus``, ``swiftfusion``, ``auto``) with the topology-aware mesh,
  grouped-query K/V with their own heads, a key-padding mask (Qwen-Image's text mask, in
  any form diffusers passes) as the strategy's key mask; an all-ones mask runs unmasked;
- keys/values the plan leaves whole on every rank (LTX-2's audio and audio prompt,
  MiniMax-H3's text refiner) attend locally, with no exchange; Wan-like models' text
  cross-attention never reaches the route (diffusers calls it without parallelism);
- queries on every rank against sharded keys (LTX-2's audio -> video) attend locally and
  merge their query-sized partial results;
- the rest runs diffusers' attention on all-gathered keys/values, logged once and counted
  in ``ctx.stats()["fallbacks"]``: masks that depend on the query or are a bias, and the
  video -> text cross-attention of LTX and LTX-2, whose plans shard the (short) text with
  the video, so every rank needs every text token.

Modules (importing this package imports no diffusers and changes nothing):
- ``parallel``: ``enable_parallelism`` / ``disable_parallelism`` / ``context_of`` /
  ``attention_paths``;
- ``routing``: diffusers' attention backends routed to a context, and the paths above;
- ``masks``: diffusers' attention masks read as key-padding masks, agreed on by every rank;
- ``sites``: attention modules whose tokens are whole on every rank, marked during their call;
- ``sharding``: the rank-order mesh given to diffusers, its uneven-length error, and turning
  diffusers' context parallelism off again;
- ``plans``: the ``_cp_plan`` used (fitted to the model; LTX-2's with ``cross_attn_rope``
  split) and the modules whose tokens it leaves whole.

Not supported: causal attention (``UnsupportedAttention``), backward passes (inference only),
uneven chunks (diffusers' ``ulysses_anything`` / ``ring_anything``: a ``ValueError`` names
the inputs), masks the plan does not shard with their tokens (``UnsupportedAttention``).
"""
from __future__ import annotations

from .parallel import attention_paths, context_of, disable_parallelism, enable_parallelism
from .routing import UnsupportedAttention

__all__ = ["UnsupportedAttention", "attention_paths", "context_of", "disable_parallelism",
           "enable_parallelism"]
