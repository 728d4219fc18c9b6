"""Fixes to xFuser 0.7.0's runner while a strategy is routed (diffs in
``patches/xfuser-0.7.0-plugin.patch``).

Flux (runner wrapper ``xFuserFlux1Transformer2DWrapper``):
1. an image length not divisible by the SP degree calls the missing ``_pad_to_sp_divisible``
   (and xFuser's zero padding would be attended to): a clear error naming the constraint;
2. a text length not divisible by the SP degree replicates text on every rank and USP then
   counts text K/V once per rank (~4e-2 error): the text is passed as joint tensors
   (``joint_strategy="front"``) instead, exact for every strategy including ``usp``.
Teardown: the runner's cleanup tears xFuser's groups down; the routed context closes first.
"""
from __future__ import annotations

import functools
from types import ModuleType

from . import routing
from .routing import PluginError


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


