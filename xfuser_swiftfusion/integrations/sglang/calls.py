"""One ``USPAttention.forward`` call, read: which path it needs and its tensors in our layout.

SGLang passes q, k, v ``[B, S_local, H, D]`` (k, v ``H_kv`` heads under GQA), the sequence
sharded in SP-rank order; ``num_replicated_prefix`` / ``num_replicated_suffix`` leading /
trailing rows are the same on every rank (joint text). ``SequenceParallelContext.attention``
takes ``[B, H, S_local, D]`` and text as joint tensors ``front`` / ``rear``; it returns
``[B, H, Tj + S_local, D]`` with the text rows where they came in, as SGLang returns them.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

# arguments of USPAttention.forward that our strategies take (with these values)
_PLAIN = {"attn_mask": None, "num_replicated_kv_prefix": 0,
          "skip_sequence_parallel_override": False, "attn_mask_meta": None,
          "qkv_pre_all_to_all": False, "seq_lens": None, "q_prefix": None,
          "k_prefix": None, "v_prefix": None}
_REASONS = {"attn_mask": "attention mask", "num_replicated_kv_prefix": "replicated K/V prefix",
            "skip_sequence_parallel_override": "skip_sequence_parallel_override",
            "attn_mask_meta": "attention mask metadata (varlen / tail pad)",
            "qkv_pre_all_to_all": "q/k/v already exchanged (qkv_pre_all_to_all)",
            "seq_lens": "packed variable-length sequences (seq_lens)",
            "q_prefix": "segmented q/k/v prefix", "k_prefix": "segmented q/k/v prefix",
            "v_prefix": "segmented q/k/v prefix"}


@dataclass
class Call:
    layer: torch.nn.Module
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    prefix: int
    suffix: int


def bind(signature: inspect.Signature, args: tuple, kwargs: dict) -> dict:
    """The call's arguments by name, defaults filled in (``self`` included)."""
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def unsupported(arguments: dict) -> str | None:
    """Why our strategies do not take this call (None: they do)."""
    layer = arguments["self"]
    for name, plain in _PLAIN.items():
        value = arguments.get(name, plain)
        if (value is not None) if plain is None else bool(value):
            return _REASONS[name]
    if getattr(layer, "skip_sequence_parallel", False):
        return "skip_sequence_parallel layer (replicated K/V)"
    if getattr(layer, "causal", False):
        return "causal attention"
    if getattr(layer, "dropout_p", 0.0):
        return "attention dropout"
    backend = getattr(layer, "backend", None)
    if backend is not None and getattr(backend, "is_sparse", False):
        return f"sparse attention backend {getattr(backend, 'name', backend)}"
    if arguments.get("num_replicated_prefix", 0) and arguments.get("num_replicated_suffix", 0):
        return "replicated prefix and suffix in one call"
    q, k = arguments["q"], arguments["k"]
    if q.dim() != 4 or k.shape[1] != q.shape[1] or arguments["v"].shape[1] != q.shape[1]:
        return "q and k/v of different lengths (cross-attention)"
    return None


def read(arguments: dict) -> Call:
    return Call(arguments["self"], arguments["q"], arguments["k"], arguments["v"],
                int(arguments.get("num_replicated_prefix", 0) or 0),
                int(arguments.get("num_replicated_suffix", 0) or 0))


def run(call: Call, attention) -> torch.Tensor:
    """``attention`` (a context's) on the call; SGLang's ``[B, rows, H, D]`` out."""
    q, k, v = call.q, call.k, call.v
    T = call.prefix or call.suffix
    heads = lambda x: x.transpose(1, 2)  # noqa: E731  [B, S, H, D] <-> [B, H, S, D]
    if T == 0:
        out = attention(heads(q), heads(k), heads(v), scale=call.layer.softmax_scale)
        return heads(out).contiguous()
    if call.prefix:
        text, image = slice(0, T), slice(T, None)
        where = "front"
    else:
        text, image = slice(q.shape[1] - T, None), slice(0, q.shape[1] - T)
        where = "rear"
    out = attention(heads(q[:, image]), heads(k[:, image]), heads(v[:, image]),
                    heads(q[:, text]), heads(k[:, text]), heads(v[:, text]), where,
                    scale=call.layer.softmax_scale)
    return heads(out).contiguous()
