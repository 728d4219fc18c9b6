"""Which xFuser ``USP()`` calls our strategies run, and why the others go to xFuser's own USP.

``fallback_reason`` names the first feature of a call that the strategies do not implement;
the router then hands that call to xFuser's USP (logged once, counted per reason in
``ctx.stats()["fallbacks"]``). xFuser's USP runs correctly on the TAS-placed groups.

``attention_kwargs``: a key in ``IGNORED_ATTENTION_KWARGS`` is read only by a path our
strategies replace and is ignored (the table says why); a key in ``KEY_MASK_ATTENTION_KWARGS``
is honoured as a key-padding mask where ``key_mask_reason`` finds none; any other key with a
value falls back, so a key we do not know is never dropped.

Grouped-query attention (``kv_head_repeat``, K/V with fewer heads) runs natively.

FP8 communication (``--use_fp8_comms``, xFuser's ``runtime_state.fp8_comms``): a context
built with ``fp8_comms`` (``use_strategy(..., fp8_comms=True)``, which ``--sp-strategy``
passes from the flag) runs it: tas, torus and swiftfusion send what crosses machines as FP8
with per-slot scales (``strategies/fp8.py``), text tokens included. A context without it
falls back for the calls xFuser's USP would quantize.
"""
from __future__ import annotations

import torch

# key -> why our strategies may ignore it. Sparse-attention settings: read only by xFuser's
# SpargeAttn / VSA backends (``core/distributed/attention_backend.py``); with a sparse
# backend active the call falls back as a whole (``SPARSE_BACKEND_MARKERS``). Wan's runner
# passes all of them on every call (``runner_models/wan.py::_build_attention_kwargs``).
_SPARSE = "a SpargeAttn / VSA setting, read only by xFuser's sparse attention backends"
IGNORED_ATTENTION_KWARGS: dict[str, str] = {
    "thw": "the latent (frames, height, width) grid, read only by VSA",
    **{key: _SPARSE for key in (
        "spargeattn_simthreshold", "spargeattn_cdfthreshold", "spargeattn_reorder_sequence",
        "use_spargeattn_static_block_mask", "vsa_block_size", "vsa_top_k", "vsa_top_k_ratio",
        "vsa_drop_rates", "vsa_prob_threshold", "vsa_reorder_sequence",
        "use_vsa_static_block_mask", "use_vsa_first_frame_mask", "vsa_collect_density",
        "vsa_effective_drop_rate", "vsa_use_dense", "vsa_step_index", "vsa_num_steps",
        "vsa_last_density")},
}
# Krea-2's key-padding mask (xFuser's ``AttentionMaskWithMeta``, passed by
# ``transformer_krea2.py``): ``attn_mask`` is applied by the strategies (``ctx.attention``'s
# ``key_mask``); the others are its varlen form (the same mask), used only alongside it.
_MASK_META = "varlen form of attn_mask (AttentionMaskWithMeta); the strategies apply attn_mask"
KEY_MASK_ATTENTION_KWARGS: dict[str, str] = {
    "attn_mask": "bool [B, 1, 1, L] key-padding mask over the sharded sequence (True = attend)",
    "indices_k": _MASK_META, "cu_seqlens_k": _MASK_META, "max_seqlen_k": _MASK_META,
}

# an xFuser attention backend whose name holds one of these computes sparse attention
SPARSE_BACKEND_MARKERS = ("SPARGE", "VSA", "SPARSE")


def key_mask_reason(mask, query: torch.Tensor | None, sp_world: int | None,
                    joint: bool) -> str | None:
    """Why ``attn_mask`` is not a key-padding mask the strategies apply: it must be a bool
    ``[B, 1, 1, L]`` (or ``[B, L]``) tensor over the sharded sequence, ``L = sp_world *
    S_local``, on the query's device, in a call without joint tensors; None if it is."""
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        return f"not a bool tensor ({getattr(mask, 'dtype', type(mask).__name__)})"
    if query is None or sp_world is None:
        return "no query / SP degree to check it against"
    if joint:
        return "with joint tensors"
    B, L = query.shape[0], query.shape[2] * sp_world
    if tuple(mask.shape) not in ((B, 1, 1, L), (B, L)) or mask.device != query.device:
        return f"shape {tuple(mask.shape)} on {mask.device}, not [B={B}, 1, 1, L={L}] on {query.device}"
    return None


def attention_kwargs_reason(attention_kwargs: dict | None, query: torch.Tensor | None = None,
                            sp_world: int | None = None, joint: bool = False) -> str | None:
    """Why ``attention_kwargs`` needs xFuser's USP: the keys with a value that are neither in
    ``IGNORED_ATTENTION_KWARGS`` nor an applicable key mask (``key_mask_reason``; its
    metadata keys only alongside ``attn_mask``), or None."""
    given = {k: v for k, v in (attention_kwargs or {}).items() if v is not None}
    used = sorted(k for k in given if k not in IGNORED_ATTENTION_KWARGS
                  and (k not in KEY_MASK_ATTENTION_KWARGS or "attn_mask" not in given))
    if "attn_mask" in given and (why := key_mask_reason(given["attn_mask"], query, sp_world, joint)):
        return f"attention_kwargs ['attn_mask'] ({why})"
    return f"attention_kwargs {used}" if used else None


def sparse_backend_reason(backend_name: str | None) -> str | None:
    """A sparse attention backend is configured: our strategies compute dense attention."""
    if backend_name and any(m in backend_name.upper() for m in SPARSE_BACKEND_MARKERS):
        return f"sparse attention backend {backend_name}"
    return None


def fallback_reason(query: torch.Tensor, key: torch.Tensor, dropout_p: float, is_causal: bool,
                    attn_layer, backend, attention_kwargs: dict | None, head_balance_layer,
                    kv_head_repeat: int, joint_strategy: str | None,
                    num_heads: int, sp_world: int | None = None,
                    fp8_comms: bool = False) -> str | None:
    """Why this USP call needs xFuser's own USP, or None when the strategy can run it
    (``sp_world``: the SP degree, to check a key mask's length; ``fp8_comms``: the strategy
    sends its inter-machine transfers as FP8 itself)."""
    from xfuser.core.distributed import (get_pipeline_parallel_world_size, get_runtime_state,
                                         get_ulysses_parallel_world_size)
    from xfuser.model_executor.layers.usp import _has_kv_cache

    state = get_runtime_state()
    fp8_module = attn_layer if attn_layer is not None else head_balance_layer
    if (not fp8_comms and getattr(state, "fp8_comms", None) is not None and fp8_module is not None
            and not joint_strategy and get_ulysses_parallel_world_size() > 1):
        return "FP8 communication (--use_fp8_comms) on a context built without fp8_comms"
    # xFuser's older wrappers register a KV-cache entry on every attention layer even at
    # pp = 1 (SD3.5): it is PipeFusion's only when PipeFusion runs
    if get_pipeline_parallel_world_size() > 1 and _has_kv_cache(attn_layer):
        return "PipeFusion KV cache"
    backend_name = getattr(getattr(state, "attention_backend", None), "name", None)
    if reason := sparse_backend_reason(backend_name):
        return reason
    if key.shape[1] == 0 or query.shape[1] % key.shape[1] or key.shape[1] * kv_head_repeat not in (query.shape[1], key.shape[1]):
        return (f"{key.shape[1]} K/V heads with kv_head_repeat={kv_head_repeat} for "
                f"{query.shape[1]} query heads")
    if is_causal:
        return "causal mask"
    if dropout_p:
        return "dropout > 0"
    # a wrapper that passes the runtime's own backend (MiniMax-H3) asks for nothing special
    if backend is not None and backend != getattr(state, "attention_backend", None):
        return f"explicit attention backend {getattr(backend, 'name', backend)}"
    if reason := attention_kwargs_reason(attention_kwargs, query, sp_world, joint_strategy is not None):
        return reason
    if (head_balance_layer is not None
            and getattr(state.runtime_config, "use_spargeattn_head_balance", False)):
        return "sparge head balancing"
    if query.shape[1] != num_heads:
        return f"{query.shape[1]} heads (the strategy was set up for {num_heads})"
    return None


__all__ = ["IGNORED_ATTENTION_KWARGS", "KEY_MASK_ATTENTION_KWARGS", "SPARSE_BACKEND_MARKERS",
           "attention_kwargs_reason", "fallback_reason", "key_mask_reason", "sparse_backend_reason"]
