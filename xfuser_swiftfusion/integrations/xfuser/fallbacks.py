"""Which xFuser ``USP()`` calls our strategies run, and why the others go to xFuser's own USP.

``fallback_reason`` names the first feature of a call that the strategies do not implement;
the router then hands that call to xFuser's USP (logged once, counted per reason in
``ctx.stats()["fallbacks"]``). xFuser's USP runs correctly on the TAS-placed groups.

``attention_kwargs``: a key in ``IGNORED_ATTENTION_KWARGS`` is read only by a path our
strategies replace and is ignored (the table says why); any other key with a value falls
back, so a key we do not know is never dropped.
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
# an xFuser attention backend whose name holds one of these computes sparse attention
SPARSE_BACKEND_MARKERS = ("SPARGE", "VSA", "SPARSE")


def attention_kwargs_reason(attention_kwargs: dict | None) -> str | None:
    """Why ``attention_kwargs`` needs xFuser's USP: the keys with a value that are not in
    ``IGNORED_ATTENTION_KWARGS``, or None."""
    used = sorted(k for k, v in (attention_kwargs or {}).items()
                  if v is not None and k not in IGNORED_ATTENTION_KWARGS)
    return f"attention_kwargs {used}" if used else None


def sparse_backend_reason(backend_name: str | None) -> str | None:
    """A sparse attention backend is configured: our strategies compute dense attention."""
    if backend_name and any(m in backend_name.upper() for m in SPARSE_BACKEND_MARKERS):
        return f"sparse attention backend {backend_name}"
    return None


def fallback_reason(query: torch.Tensor, key: torch.Tensor, dropout_p: float, is_causal: bool,
                    attn_layer, backend, attention_kwargs: dict | None, head_balance_layer,
                    kv_head_repeat: int, joint_strategy: str | None,
                    num_heads: int) -> str | None:
    """Why this USP call needs xFuser's own USP, or None when the strategy can run it."""
    from xfuser.core.distributed import (get_pipeline_parallel_world_size, get_runtime_state,
                                         get_ulysses_parallel_world_size)
    from xfuser.model_executor.layers.usp import _has_kv_cache

    state = get_runtime_state()
    fp8_module = attn_layer if attn_layer is not None else head_balance_layer
    if (getattr(state, "fp8_comms", None) is not None and fp8_module is not None
            and not joint_strategy and get_ulysses_parallel_world_size() > 1):
        return "FP8 communication (--use_fp8_comms)"
    # xFuser's older wrappers register a KV-cache entry on every attention layer even at
    # pp = 1 (SD3.5): it is PipeFusion's only when PipeFusion runs
    if get_pipeline_parallel_world_size() > 1 and _has_kv_cache(attn_layer):
        return "PipeFusion KV cache"
    backend_name = getattr(getattr(state, "attention_backend", None), "name", None)
    if reason := sparse_backend_reason(backend_name):
        return reason
    if kv_head_repeat != 1 or key.shape[1] != query.shape[1]:
        return "grouped-query attention (kv_head_repeat > 1)"
    if is_causal:
        return "causal mask"
    if dropout_p:
        return "dropout > 0"
    if backend is not None:
        return f"explicit attention backend {getattr(backend, 'name', backend)}"
    if reason := attention_kwargs_reason(attention_kwargs):
        return reason
    if (head_balance_layer is not None
            and getattr(state.runtime_config, "use_spargeattn_head_balance", False)):
        return "sparge head balancing"
    if query.shape[1] != num_heads:
        return f"{query.shape[1]} heads (the strategy was set up for {num_heads})"
    return None


__all__ = ["IGNORED_ATTENTION_KWARGS", "SPARSE_BACKEND_MARKERS", "attention_kwargs_reason",
           "fallback_reason", "sparse_backend_reason"]
