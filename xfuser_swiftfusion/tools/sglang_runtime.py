"""SGLang's distributed state on a rank of ours (an emulated rank or a torchrun rank whose
default process group exists), as SGLang's worker builds it before loading a model.

``setup(ulysses, ring)`` builds SGLang's world, its model-parallel groups (SP over every rank,
split ``ulysses`` x ``ring``: Ulysses groups contiguous ranks, ring groups strided) and default
server arguments; calling it again switches the split (SGLang supports repeated Ulysses/Ring
switches: ``destroy_model_parallel``). SGLang's CPU custom ops call ``sgl_kernel``'s CPU build
(``torch.ops.sgl_kernel.*_cpu``); where that is absent (an install without ``sgl_kernel``'s
CPU wheel) ``setup`` dispatches them to their ``forward_native`` in this process only.
Importing this module imports no SGLang.
"""
from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist


def default_server_args():
    """SGLang's ``ServerArgs`` with every field at its default (no model, no ``__post_init__``)."""
    from sglang.multimodal_gen.runtime.server_args import ServerArgs
    args = ServerArgs.__new__(ServerArgs)
    for f in dataclasses.fields(ServerArgs):
        if f.default is not dataclasses.MISSING:
            setattr(args, f.name, f.default)
        elif f.default_factory is not dataclasses.MISSING:
            setattr(args, f.name, f.default_factory())
    args.kv_gather_degree = 1  # SGLang's Ulysses exchange (its default resolves it at startup)
    return args


def setup(ulysses: int | None = None, ring: int = 1, cfg: int = 1) -> None:
    """SGLang's groups over the default group: ``cfg`` CFG-parallel halves, each an SP group of
    ``world / cfg`` contiguous ranks split ``ulysses`` x ``ring``."""
    from sglang.multimodal_gen.runtime.distributed import parallel_state as ps
    from sglang.multimodal_gen.runtime.server_args import set_global_server_args
    _native_custom_ops()
    rank, world = dist.get_rank(), dist.get_world_size()
    backend = dist.get_backend()
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    set_global_server_args(default_server_args())
    # on CUDA the device of this rank (torchrun's LOCAL_RANK); CPU ranks keep their global rank
    local_rank = int(os.environ.get("LOCAL_RANK", rank)) if torch.cuda.is_available() else rank
    ps.init_distributed_environment(world_size=world, rank=rank, local_rank=local_rank,
                                    backend=backend)
    sp = world // cfg
    ps.initialize_model_parallel(sequence_parallel_degree=sp, classifier_free_guidance_degree=cfg,
                                 ulysses_degree=ulysses or sp // ring, ring_degree=ring,
                                 backend=backend)


def _native_custom_ops() -> None:
    """SGLang's custom ops run ``forward_native`` on CPU when sgl_kernel's CPU ops are absent."""
    from sglang.multimodal_gen.runtime.layers.custom_op import CustomOp
    if hasattr(torch.ops.sgl_kernel, "fused_norm_scale_shift_cpu"):
        return
    if getattr(CustomOp.dispatch_forward, "_swiftfusion_native", False):
        return
    dispatch = CustomOp.dispatch_forward

    def dispatch_native(self):
        method = dispatch(self)
        return self.forward_native if getattr(method, "__name__", "") == "forward_cpu" else method

    dispatch_native._swiftfusion_native = True
    CustomOp.dispatch_forward = dispatch_native


def teardown() -> None:
    from sglang.multimodal_gen.runtime.distributed import parallel_state as ps
    ps.destroy_model_parallel()


def forward_context():
    """The forward context SGLang's attention reads (no metadata: dense attention)."""
    from sglang.multimodal_gen.runtime.managers.forward_context import set_forward_context
    return set_forward_context(current_timestep=0, attn_metadata=None)


__all__ = ["default_server_args", "forward_context", "setup", "teardown"]
