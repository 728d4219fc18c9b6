"""SGLang integration: SGLang's diffusion runtime (``sglang.multimodal_gen``) with its attention
on a SwiftFusion strategy.

    pip install "xfuser-swiftfusion[sglang]"           # registers the plugin (entry point)
    SWIFTFUSION_STRATEGY=swiftfusion sglang generate ... --num-gpus 16 --sp-degree 16 \\
        --nnodes 2 --node-rank 0 --dist-init-addr HOST:PORT

Every DiT attention of SGLang that goes through ``USPAttention`` (Flux, Qwen-Image, Wan,
Z-Image, ...) runs on the strategy over SGLang's SP group, on the mesh this project chooses for
the machines the ranks run on (``contexts``): plain self-attention, GQA, and joint text passed
as a replicated prefix or suffix. Masks, a replicated K/V prefix, packed sequences, causal or
cross-attention layers (``skip_sequence_parallel``) run SGLang's own path, counted in the
context's ``stats()["fallbacks"]`` and logged once (``calls``). Without a strategy nothing
changes.

Modules (importing this package imports no SGLang):
- ``config``: the strategy (``$SWIFTFUSION_STRATEGY`` or ``configure``);
- ``calls``: which calls run on the strategy, and SGLang's ``[B, S, H, D]`` in our layout;
- ``contexts``: one context per head count over SGLang's SP group (``active()``);
- ``hooks``: the AROUND hook on ``USPAttention.forward`` (and one declining Qwen-Image's
  caller-side Ulysses exchange while a strategy runs; eager breaks under SGLang's
  breakable CUDA graphs, a graph break under ``torch.compile``);
- ``plugin``: the entry point's ``register`` and ``install`` / ``uninstall`` in a process.
"""
from __future__ import annotations

from .config import STRATEGY_ENV, configure
from .contexts import active, close_all
from .plugin import install, installed, register, uninstall

__all__ = ["STRATEGY_ENV", "active", "close_all", "configure", "install", "installed",
           "register", "uninstall"]
