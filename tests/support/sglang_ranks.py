"""SGLang's distributed state on an emulated rank (after ``run_emulated`` made the gloo group):
the package's ``tools.sglang_runtime`` (``setup``, ``teardown``, ``forward_context``).

SGLang's Ring on CPU is refused at layer construction (torch SDPA returns no LSE: "Ring
Attention requires a backend whose kernel exposes the softmax LSE"), so its baseline here is
Ulysses over all ranks; our strategies choose their own mesh.
"""
from __future__ import annotations

from xfuser_swiftfusion.tools.sglang_runtime import (default_server_args, forward_context,
                                                     setup, teardown)

__all__ = ["default_server_args", "forward_context", "setup", "teardown"]
