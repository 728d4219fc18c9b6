"""Fixes to xFuser 0.7.0's runner wrappers while a strategy is routed (diffs in
``patches/xfuser-0.7.0-plugin.patch``).

Text of any length, exact: every wrapper below keeps xFuser's split of the text across the SP
ranks when its length is divisible by the SP degree; otherwise the text is replicated on every
rank and attended to once, as joint tokens in front of the image tokens
(``joint_strategy="front"``: ``routing.flux_text`` holds the text length while the wrapper
runs, ``routing.routed_usp`` splits the ``[B, H, T + S_local, D]`` rows into text and image).
Image lengths not divisible by the SP degree: a clear error naming the constraint (xFuser pads
them with zero tokens that every query attends to).

Flux (``xFuserFlux1Transformer2DWrapper``): the image padding calls the missing
``_pad_to_sp_divisible``; replicated text was counted once per rank (~4e-2 error).
FLUX.2 (``xFuserFlux2Transformer2DWrapper``): the text is ``torch.chunk``-ed unevenly (ranks
disagree on the sequence length: USP fails or hangs).
Qwen-Image (``xFuserQwenImageTransformerWrapper``): the text is zero-padded into the keys
(~1e-3 error); a text mask with padding is ignored by its processor (clear error instead).
Teardown: the runner's cleanup tears xFuser's groups down; the routed context closes first.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
from types import ModuleType
from typing import Iterator

import torch

from . import routing
from .routing import PluginError

FLUX2_MODULE = "xfuser.model_executor.models.transformers.transformer_flux2"
QWEN_MODULE = "xfuser.model_executor.models.transformers.transformer_qwen"

# Qwen-Image: the text length while its wrapper runs with replicated text (else None).
_qwen_text = contextvars.ContextVar("swiftfusion_qwen_replicated_text", default=None)


def _check_image_tokens(model: str, tokens: int, sp: int, fix: str) -> None:
    """``PluginError`` unless ``tokens`` image tokens split evenly over ``sp`` ranks."""
    if tokens % sp:
        raise PluginError(
            f"{model}: {tokens} image tokens are not divisible by the SP degree {sp} (xFuser "
            f"0.7.0 would pad them with tokens every query attends to); {fix}")


@contextlib.contextmanager
def _replicated_text(text: int) -> Iterator[None]:
    """``routing.flux_text`` = ``text`` (text rows in front of every USP call) while open."""
    token = routing.flux_text.set(text)
    try:
        yield
    finally:
        routing.flux_text.reset(token)


def patch_flux_wrapper(module: ModuleType) -> None:
    """While a strategy is routed: clear error for image lengths not divisible by the SP
    degree (bug 1), text passed as joint tokens when its length is not (bug 2)."""
    cls = module.xFuserFlux1Transformer2DWrapper
    original = cls.forward
    if getattr(original, "__swiftfusion__", False):
        return

    @functools.wraps(original)
    def forward(self, hidden_states, encoder_hidden_states=None, *args, **kwargs):
        if routing.routed_context() is None:
            return original(self, hidden_states, encoder_hidden_states, *args, **kwargs)
        sp = module.get_sequence_parallel_world_size()
        if hidden_states.shape[1] % sp:
            raise PluginError(
                f"Flux: {hidden_states.shape[1]} image tokens are not divisible by the SP degree "
                f"{sp} (xFuser 0.7.0 would pad them with tokens every query attends to); choose "
                f"height and width so that (height/16)*(width/16) is a multiple of {sp}")
        text = encoder_hidden_states.shape[-2]
        token = routing.flux_text.set(text if text % sp else None)
        try:
            return original(self, hidden_states, encoder_hidden_states, *args, **kwargs)
        finally:
            routing.flux_text.reset(token)

    forward.__swiftfusion__ = True
    cls.forward = forward


def patch_flux2_wrapper(module: ModuleType) -> None:
    """FLUX.2 while a strategy is routed: clear error for image lengths not divisible by the SP
    degree, text replicated and attended to as joint tokens when its length is not."""
    cls = module.xFuserFlux2Transformer2DWrapper
    original = cls.forward
    if getattr(original, "__swiftfusion__", False):
        return

    @functools.wraps(original)
    def forward(self, hidden_states, encoder_hidden_states=None, *args, timestep=None,
                img_ids=None, txt_ids=None, **kwargs):
        if routing.routed_context() is None:
            return original(self, hidden_states, encoder_hidden_states, *args,
                            timestep=timestep, img_ids=img_ids, txt_ids=txt_ids, **kwargs)
        sp = module.get_sequence_parallel_world_size()
        _check_image_tokens("FLUX.2", hidden_states.shape[1], sp,
                            f"choose height and width so that (height/16)*(width/16) is a "
                            f"multiple of {sp}")
        text = encoder_hidden_states.shape[-2]
        if text % sp == 0:   # xFuser splits text and image evenly: exact as it is
            return original(self, hidden_states, encoder_hidden_states, *args,
                            timestep=timestep, img_ids=img_ids, txt_ids=txt_ids, **kwargs)
        with _replicated_text(text):
            return _flux2_forward_replicated_text(
                module, self, hidden_states, encoder_hidden_states, *args, timestep=timestep,
                img_ids=img_ids, txt_ids=txt_ids, **kwargs)

    forward.__swiftfusion__ = True
    cls.forward = forward


def _flux2_forward_replicated_text(module: ModuleType, model, hidden_states: torch.Tensor,
                                   encoder_hidden_states: torch.Tensor, *args,
                                   timestep=None, img_ids=None, txt_ids=None, **kwargs):
    """xFuser's ``xFuserFlux2Transformer2DWrapper.forward`` with the text (and its ids)
    replicated instead of split: image ``[B, S, C]`` / ids ``[(B,) S, 4]`` split over the SP
    ranks (``S`` divisible), text ``[B, T, C]`` / ids ``[(B,) T, 4]`` whole on every rank."""
    cfg, cfg_rank = (module.get_classifier_free_guidance_world_size(),
                     module.get_classifier_free_guidance_rank())
    sp, sp_rank = module.get_sequence_parallel_world_size(), module.get_sequence_parallel_rank()
    if (isinstance(timestep, torch.Tensor) and timestep.ndim != 0
            and timestep.shape[0] == hidden_states.shape[0]):
        timestep = torch.chunk(timestep, cfg, dim=0)[cfg_rank]
    hidden_states = torch.chunk(hidden_states, cfg, dim=0)[cfg_rank]
    hidden_states = torch.chunk(hidden_states, sp, dim=-2)[sp_rank]       # [B, S/sp, C]
    encoder_hidden_states = torch.chunk(encoder_hidden_states, cfg, dim=0)[cfg_rank]
    img_ids = torch.chunk(img_ids, sp, dim=-2)[sp_rank]                   # [(B,) S/sp, 4]
    output = module.Flux2Transformer2DModel.forward(
        model, hidden_states, encoder_hidden_states, *args, timestep=timestep,
        img_ids=img_ids, txt_ids=txt_ids, **kwargs)
    return_dict = not isinstance(output, tuple)
    sample = module.get_sp_group().all_gather(output[0], dim=-2)        # [B/cfg, S, C]
    sample = module.get_cfg_group().all_gather(sample, dim=0)           # [B, S, C]
    if return_dict:
        return output.__class__(sample, *output[1:])
    return (sample, *output[1:])


def patch_qwen_wrapper(module: ModuleType) -> None:
    """Qwen-Image while a strategy is routed: clear errors for image lengths not divisible by
    the SP degree and for text masks with padding (its processor ignores masks); text
    replicated and attended to as joint tokens when its length is not divisible.

    The wrapper's ``chunk_and_pad_sequence`` (module global) returns the text and its RoPE
    rows whole while ``_qwen_text`` is set: with the image checked divisible, the calls that
    would pad are exactly those two."""
    cls = module.xFuserQwenImageTransformerWrapper
    original = cls.forward
    if getattr(original, "__swiftfusion__", False):
        return
    chunk = module.chunk_and_pad_sequence

    def chunk_and_pad_sequence(x: torch.Tensor, sp_world_rank: int, sp_world_size: int,
                               pad_amount: int, dim: int) -> torch.Tensor:
        text = _qwen_text.get()
        if text is None or pad_amount == 0:
            return chunk(x, sp_world_rank, sp_world_size, pad_amount, dim)
        if x.shape[dim] != text:
            raise AssertionError(f"Qwen-Image: only the {text} text rows may be replicated, "
                                 f"not a dim of {x.shape[dim]}")
        return x                      # [B, T, C] text / [T, D/2] text RoPE, whole

    @functools.wraps(original)
    def forward(self, hidden_states, encoder_hidden_states=None,
                encoder_hidden_states_mask=None, *args, **kwargs):
        if routing.routed_context() is None:
            return original(self, hidden_states, encoder_hidden_states,
                            encoder_hidden_states_mask, *args, **kwargs)
        sp = module.get_sequence_parallel_world_size()
        _check_image_tokens("Qwen-Image", hidden_states.shape[1], sp,
                            f"choose height and width so that (height/16)*(width/16) is a "
                            f"multiple of {sp}")
        if encoder_hidden_states_mask is not None and not bool(encoder_hidden_states_mask.all()):
            raise PluginError(
                "Qwen-Image: the text mask pads some prompts, and xFuser 0.7.0's Qwen-Image "
                "attention ignores masks (padding tokens would be attended to); use one "
                "prompt per batch or prompts of the same token length")
        text = encoder_hidden_states.shape[1]
        if text % sp == 0:   # xFuser splits text and image evenly: exact as it is
            return original(self, hidden_states, encoder_hidden_states,
                            encoder_hidden_states_mask, *args, **kwargs)
        token = _qwen_text.set(text)
        try:
            with _replicated_text(text):
                return original(self, hidden_states, encoder_hidden_states,
                                encoder_hidden_states_mask, *args, **kwargs)
        finally:
            _qwen_text.reset(token)

    forward.__swiftfusion__ = True
    chunk_and_pad_sequence.__swiftfusion__ = True
    module.chunk_and_pad_sequence = chunk_and_pad_sequence
    cls.forward = forward


def patch_runtime_teardown(runtime_state: ModuleType) -> None:
    """The runner's cleanup tears xFuser's groups down: close the routed context first."""
    cls = runtime_state.RuntimeState
    original = cls.destroy_distributed_env
    if getattr(original, "__swiftfusion__", False):
        return

    @functools.wraps(original)
    def destroy_distributed_env(self):
        routing.hand_state_to_xfuser()   # xFuser destroys its own groups next
        return original(self)

    destroy_distributed_env.__swiftfusion__ = True
    cls.destroy_distributed_env = destroy_distributed_env


