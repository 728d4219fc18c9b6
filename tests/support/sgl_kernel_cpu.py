"""Stand-ins for sgl_kernel's CPU diffusion-norm operators (tests only).

SGLang's CPU path of its DiT modulation layers (``LayerNormScaleShift``,
``ScaleResidualLayerNormScaleShift``, ``fuse_scale_shift_kernel``) calls three operators of
sgl_kernel's CPU build, which the ``--no-deps`` install lacks (``sgl_kernel`` is not on PyPI
for CPU). ``install()`` registers them as ``torch.ops.sgl_kernel.*`` with the semantics of
sgl-kernel's ``csrc/cpu`` diffusion-norm kernels (and sglang's CPU test of them,
``TestDiffusionNorm``): inputs ``[B, S, D]``; ``scale`` / ``shift`` / ``gate`` already expanded
to ``[B, S, D]`` (hidden stride 0 or 1); every step in fp32; the normalized row, and the gated
residual, rounded to the activation dtype before modulation; norm weight / bias fp32.

- ``fused_scale_shift_cpu(x, scale, shift, c)``: ``x * (c + scale) + shift``
- ``fused_norm_scale_shift_cpu(x, w, b, scale, shift, norm_type, eps)``:
  ``norm(x) * (1 + scale) + shift`` (``norm_type`` ``"rms"`` or ``"layer"``)
- ``fused_scale_residual_norm_scale_shift_cpu(residual, x, gate, w, b, scale, shift, norm_type,
  eps)``: ``r = residual + x * gate`` (gate None: 1); returns ``(norm(r) * (1 + scale) + shift, r)``

The real kernels dispatch bf16/fp16 activations; these also take fp32 (the tests' dtype),
where each rounding step is the identity. ``sgl_kernel`` itself becomes an empty module (its
other names raise ``ImportError``) so ``import sgl_kernel`` before an op call succeeds. A real
sgl_kernel with these operators is always preferred; nothing a user installs changes.
"""
from __future__ import annotations

import importlib.util
import sys
import types

import torch

_NAMES = ("fused_scale_shift_cpu", "fused_norm_scale_shift_cpu",
          "fused_scale_residual_norm_scale_shift_cpu")
_library: list = []  # keeps the registration alive


def _check(x: torch.Tensor, *params: torch.Tensor | None) -> None:
    if x.dim() != 3 or x.stride(-1) != 1:
        raise RuntimeError("sgl_kernel stand-in: input must be [B, S, D], last dim contiguous")
    for p in params:
        if p is not None and (p.shape != x.shape or p.stride(2) not in (0, 1)):
            raise RuntimeError("sgl_kernel stand-in: modulation tensors must be expanded to "
                               f"{tuple(x.shape)} with hidden stride 0 or 1, got {tuple(p.shape)}")


def _norm(x32: torch.Tensor, weight, bias, norm_type: str, eps: float) -> torch.Tensor:
    if norm_type == "rms":
        out = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + eps)
        bias = None  # the RMS kernel takes no bias
    elif norm_type == "layer":
        mean = x32.mean(-1, keepdim=True)
        var = x32.square().mean(-1, keepdim=True) - mean.square()
        out = (x32 - mean) * torch.rsqrt(var + eps)
    else:
        raise RuntimeError('norm_type must be "rms" or "layer".')
    for p, name in ((weight, "weight"), (bias, "bias")):
        if p is not None and p.dtype != torch.float32:
            raise RuntimeError(f"CPU fused diffusion norm only supports FP32 norm {name}.")
    if weight is not None:
        out = out * weight
    if bias is not None:
        out = out + bias
    return out


def fused_scale_shift_cpu(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor,
                          scale_constant: float) -> torch.Tensor:
    _check(x, scale, shift)
    return (x.float() * (scale_constant + scale.float()) + shift.float()).to(x.dtype)


def fused_norm_scale_shift_cpu(x, weight, bias, scale, shift, norm_type: str, eps: float):
    _check(x, scale, shift)
    normalized = _norm(x.float(), weight, bias, norm_type, eps).to(x.dtype).float()
    return (normalized * (1.0 + scale.float()) + shift.float()).to(x.dtype)


def fused_scale_residual_norm_scale_shift_cpu(residual, x, gate, weight, bias, scale, shift,
                                              norm_type: str, eps: float):
    _check(x, gate, scale, shift)
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise RuntimeError("sgl_kernel stand-in: residual must match the input")
    gated = x.float() if gate is None else x.float() * gate.float()
    residual_out = (residual.float() + gated).to(x.dtype)
    normalized = _norm(residual_out.float(), weight, bias, norm_type, eps).to(x.dtype).float()
    out = (normalized * (1.0 + scale.float()) + shift.float()).to(x.dtype)
    return out, residual_out


_SCHEMAS = {
    "fused_scale_shift_cpu":
        "(Tensor input, Tensor scale, Tensor shift, float scale_constant) -> Tensor",
    "fused_norm_scale_shift_cpu":
        "(Tensor input, Tensor? weight, Tensor? bias, Tensor scale, Tensor shift, "
        "str norm_type, float eps) -> Tensor",
    "fused_scale_residual_norm_scale_shift_cpu":
        "(Tensor residual, Tensor input, Tensor? residual_gate, Tensor? weight, Tensor? bias, "
        "Tensor scale, Tensor shift, str norm_type, float eps) -> (Tensor, Tensor)",
}


def _real() -> bool:
    """True when an importable sgl_kernel provides the operators."""
    if "sgl_kernel" in sys.modules and getattr(sys.modules["sgl_kernel"],
                                               "__swiftfusion_stub__", False):
        return False
    if importlib.util.find_spec("sgl_kernel") is None:
        return False
    try:
        importlib.import_module("sgl_kernel")
    except Exception:
        return False
    return all(hasattr(torch.ops.sgl_kernel, n) for n in _NAMES)


def install() -> bool:
    """Register the stand-ins unless a real sgl_kernel has them; True if registered (idempotent)."""
    if _library:
        return True
    if _real():
        return False
    lib = torch.library.Library("sgl_kernel", "FRAGMENT")
    for name in _NAMES:
        lib.define(name + _SCHEMAS[name])
        lib.impl(name, globals()[name], "CPU")
    _library.append(lib)
    stub = types.ModuleType("sgl_kernel")
    stub.__swiftfusion_stub__ = True
    sys.modules.setdefault("sgl_kernel", stub)
    return True
