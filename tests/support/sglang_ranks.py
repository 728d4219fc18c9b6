"""SGLang's distributed state on an emulated rank (after ``run_emulated`` made the gloo group):
the package's ``tools.sglang_runtime`` with ``sgl_kernel``'s CPU ops stood in.

SGLang runs on CPU (its ``CpuPlatform``: gloo, torch SDPA). SGLang's Ring on CPU is refused at
layer construction (torch SDPA returns no LSE: "Ring Attention requires a backend whose kernel
exposes the softmax LSE"), so its baseline here is Ulysses over all ranks; our strategies choose
their own mesh. SGLang's CPU custom ops call ``sgl_kernel``'s CPU build
(``torch.ops.sgl_kernel.*_cpu``), which the ``--no-deps`` install lacks: ``setup`` registers the
stand-ins (``support.sgl_kernel_cpu``) before SGLang's groups, so every model runs its CPU path.
"""
from __future__ import annotations

from xfuser_swiftfusion.tools import sglang_runtime
from xfuser_swiftfusion.tools.sglang_runtime import default_server_args, forward_context, teardown

from . import sgl_kernel_cpu


def setup(ulysses: int | None = None, ring: int = 1, cfg: int = 1) -> None:
    """``sglang_runtime.setup`` after the ``sgl_kernel`` CPU stand-ins are registered."""
    sgl_kernel_cpu.install()
    sglang_runtime.setup(ulysses, ring, cfg)


__all__ = ["default_server_args", "forward_context", "setup", "teardown"]
