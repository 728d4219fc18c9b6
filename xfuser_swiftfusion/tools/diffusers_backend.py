"""A CPU attention backend for diffusers' context parallelism, for comparing and benchmarking.

diffusers 0.42's ring and unified (Ulysses x Ring) attention, ``_templated_context_parallel_
attention``, merge per-block outputs by their log-sum-exp, so they need a backend registered
with ``supports_context_parallel=True`` whose ``forward_op`` returns ``(out, lse)``. Every such
backend diffusers ships runs on CUDA only (its ``native`` backend, the one that runs on CPU,
has no LSE and serves Ulysses only). ``register()`` adds ``sf_cpu_lse``: torch's fused CPU flash
attention, ``aten._scaled_dot_product_flash_attention_for_cpu`` (the kernel our strategies
and xFuser's USP run on CPU too), under diffusers' ``forward_op`` / ``backward_op`` contract:

- ``forward_op(ctx, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
  return_lse, _save_ctx=True, _parallel_config=None)``: ``query`` ``[B, S_q, H, D]``,
  ``key`` / ``value`` ``[B, S_kv, H, D]`` (model layout) -> ``out`` ``[B, S_q, H, D]`` in the
  input dtype and, with ``return_lse``, ``lse`` ``[B, S_q, H]`` fp32, natural log. With
  ``_save_ctx`` it saves ``query, key, value, out, lse`` in model layout, which diffusers' ring
  backward overrides per iteration.
- ``backward_op(ctx, grad_out, query=None, key=None, value=None, out=None, lse=None)``:
  ``grad_out`` ``[B, S_q, H, D]`` -> ``(grad_query, grad_key, grad_value)`` in model layout.

The op itself takes ``[B, H, L, D]`` and returns ``lse`` ``[B, H, L]``; each transpose below
moves between the two layouts. No attention mask, dropout or GQA: the templated ring applies a
mask unchanged to every key block, which is wrong, and the CPU op has no dropout; such calls
raise. The name lives in diffusers' ``AttentionBackendName`` (a ``str`` Enum, extended by one
member: diffusers resolves every backend name through it) and ``_AttentionBackendRegistry``.
"""
from __future__ import annotations

import threading
from typing import Any

import torch

NAME = "sf_cpu_lse"
MEMBER = "SF_CPU_LSE"
_op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_op_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
_lock = threading.Lock()


def _check_supported(attn_mask: torch.Tensor | None, dropout_p: float, enable_gqa: bool,
                     query: torch.Tensor) -> None:
    if query.device.type != "cpu":
        raise ValueError(f"attention backend {NAME!r} runs on CPU tensors, got {query.device}; "
                         "on CUDA use diffusers' '_native_flash' or 'flash'")
    if attn_mask is not None:
        raise ValueError(f"attention backend {NAME!r} takes no attention mask (diffusers' ring "
                         "attention would apply it unchanged to every key block)")
    if dropout_p:
        raise ValueError(f"attention backend {NAME!r} has no dropout (dropout_p={dropout_p})")
    if enable_gqa:
        raise ValueError(f"attention backend {NAME!r} has no grouped-query attention")


def forward_op(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
               is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
               return_lse: bool = False, _save_ctx: bool = True,
               _parallel_config: Any = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """diffusers' templated ``forward_op``: ``[B, S_q, H, D]`` x ``[B, S_kv, H, D]`` ->
    ``out`` ``[B, S_q, H, D]`` (and ``lse`` ``[B, S_q, H]`` fp32 with ``return_lse``)."""
    _check_supported(attn_mask, dropout_p, enable_gqa, query)
    # [B, S, H, D] -> [B, H, S, D] (views: the op reads strided inputs)
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))
    out, lse = _op(q, k, v, dropout_p=0.0, is_causal=is_causal, scale=scale)
    out = out.transpose(1, 2).contiguous()  # [B, H, S_q, D] -> [B, S_q, H, D]
    lse = lse.transpose(1, 2).contiguous()  # [B, H, S_q] -> [B, S_q, H]
    if _save_ctx and ctx is not None:
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.is_causal, ctx.scale = is_causal, scale
    return (out, lse) if return_lse else out


def backward_op(ctx: Any, grad_out: torch.Tensor, *args: Any, query: torch.Tensor | None = None,
                key: torch.Tensor | None = None, value: torch.Tensor | None = None,
                out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """diffusers' templated ``backward_op``: gradients ``[B, S, H, D]`` of the saved (or, in the
    ring's loop, the given) ``query, key, value``; ``out`` and ``lse`` are the final ones."""
    saved = dict(zip(("query", "key", "value", "out", "lse"), ctx.saved_tensors))
    given = dict(query=query, key=key, value=value, out=out, lse=lse)
    t = {n: saved[n] if given[n] is None else given[n] for n in saved}
    # [B, S, H, D] -> [B, H, S, D]; lse [B, S, H] -> [B, H, S]
    q, k, v, o, g = (x.transpose(1, 2) for x in (t["query"], t["key"], t["value"],
                                                 t["out"].to(t["query"].dtype), grad_out))
    grads = _op_backward(g.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(),
                         o.contiguous(), t["lse"].transpose(1, 2).contiguous(), 0.0,
                         ctx.is_causal, scale=ctx.scale)
    return tuple(x.transpose(1, 2).contiguous() for x in grads)  # [B, H, S, D] -> [B, S, H, D]


def sf_cpu_lse_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                         is_causal: bool = False, scale: float | None = None,
                         enable_gqa: bool = False, return_lse: bool = False,
                         _parallel_config: Any = None):
    """The registered backend: ``[B, S, H, D]`` in and out (``lse`` ``[B, S, H]``); with a
    context-parallel config, diffusers' templated Ulysses / ring / unified attention on it."""
    from diffusers.models.attention_dispatch import _templated_context_parallel_attention
    if _parallel_config is None:
        return forward_op(None, query, key, value, attn_mask, dropout_p, is_causal, scale,
                          enable_gqa, return_lse, _save_ctx=False)
    _check_supported(attn_mask, dropout_p, enable_gqa, query)
    return _templated_context_parallel_attention(
        query, key, value, None, dropout_p, is_causal, scale, enable_gqa, return_lse,
        forward_op=forward_op, backward_op=backward_op, _parallel_config=_parallel_config)


def _enum_member(enum_cls: type, name: str, value: str):
    """``enum_cls(value)``, adding the member ``name`` first if it is missing."""
    member = enum_cls._value2member_map_.get(value)
    if member is not None:
        return member
    member = str.__new__(enum_cls, value)
    member._name_, member._value_ = name, value
    member.__objclass__ = enum_cls
    member._sort_order_ = len(enum_cls._member_names_)
    enum_cls._member_names_.append(name)
    enum_cls._member_map_[name] = member
    enum_cls._value2member_map_[value] = member
    return member


def register() -> str:
    """Register ``sf_cpu_lse`` with diffusers (once per process); returns its name, which
    ``model.set_attention_backend`` and ``dispatch_attention_fn(backend=...)`` accept.

    Call it before ``integrations.diffusers.enable_parallelism`` so that its routing wraps
    this backend like every other one."""
    from diffusers.models import attention_dispatch as ad
    with _lock:
        member = _enum_member(ad.AttentionBackendName, MEMBER, NAME)
        if member not in ad._AttentionBackendRegistry._backends:
            ad._AttentionBackendRegistry.register(
                member, constraints=[ad._check_device, ad._check_shape],
                supports_context_parallel=True)(sf_cpu_lse_attention)
    return NAME


def ring_backend(device_type: str) -> tuple[str | None, str]:
    """(the diffusers backend with a log-sum-exp that ring and unified attention use on
    ``device_type``, or None; the reason when None). CPU: ``sf_cpu_lse``; CUDA:
    ``_native_flash`` (torch's flash SDPA; bf16/fp16)."""
    from diffusers.models import attention_dispatch as ad
    if device_type == "cpu":
        return register(), ""
    if device_type == "cuda":
        name = ad.AttentionBackendName._NATIVE_FLASH
        if name.value in ad._AttentionBackendRegistry._supports_context_parallel:
            return name.value, ""
        return None, "diffusers registers no '_native_flash' context-parallel backend here"
    return None, (f"no diffusers attention backend with a log-sum-exp on {device_type!r} "
                  "(ring attention merges blocks by it)")


__all__ = ["NAME", "backward_op", "forward_op", "register", "ring_backend",
           "sf_cpu_lse_attention"]
