"""SGLang's distributed state on an emulated rank (after ``run_emulated`` made the gloo group).

SGLang runs on CPU (its ``CpuPlatform``: gloo, torch SDPA). ``setup(ulysses, ring)`` builds its
world, model-parallel groups (SP over every rank) and default server arguments, as its worker
does before loading a model. SGLang's Ring on CPU is refused at layer construction (torch SDPA
returns no LSE: "Ring Attention requires a backend whose kernel exposes the softmax LSE"), so
its baseline here is Ulysses over all ranks; our strategies choose their own mesh. SGLang's
CPU custom ops call ``sgl_kernel``'s CPU build (``torch.ops.sgl_kernel.*_cpu``), which the
``--no-deps`` install lacks: ``setup`` registers its stand-ins (``support.sgl_kernel_cpu``).
"""
from __future__ import annotations

import dataclasses

import torch.distributed as dist

from . import sgl_kernel_cpu


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
    """SGLang's groups over the default (gloo) group: ``cfg`` CFG-parallel halves, each an SP
    group of ``world / cfg`` contiguous ranks split ``ulysses`` x ``ring``."""
    from sglang.multimodal_gen.runtime.distributed import parallel_state as ps
    from sglang.multimodal_gen.runtime.server_args import set_global_server_args
    sgl_kernel_cpu.install()
    rank, world = dist.get_rank(), dist.get_world_size()
    set_global_server_args(default_server_args())
    ps.init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="gloo")
    sp = world // cfg
    ps.initialize_model_parallel(sequence_parallel_degree=sp, classifier_free_guidance_degree=cfg,
                                 ulysses_degree=ulysses or sp // ring, ring_degree=ring,
                                 backend="gloo")


def teardown() -> None:
    from sglang.multimodal_gen.runtime.distributed import parallel_state as ps
    ps.destroy_model_parallel()


def forward_context():
    """The forward context SGLang's attention reads (no metadata: dense attention)."""
    from sglang.multimodal_gen.runtime.managers.forward_context import set_forward_context
    return set_forward_context(current_timestep=0, attn_metadata=None)
