"""xfuser-swiftfusion: SwiftFusion sequence parallelism for xDiT / xFuser.

    import xfuser_swiftfusion as sf
    ctx = sf.init_sequence_parallel(strategy="swiftfusion", num_heads=H)  # after dist init
    out = ctx.attention(q, k, v)            # [B, H, S_local, D], xFuser's USP contract
    ctx.close()

Importing the package applies the CPU compatibility layer for xFuser 0.7.0 (a no-op on
CUDA machines), so ``import xfuser`` and xFuser's own USP work on CPU with gloo.
"""
from . import xfuser_compat

xfuser_compat.apply()

from .context import SequenceParallelContext, init_sequence_parallel  # noqa: E402
from .strategies import STRATEGIES  # noqa: E402
from .topology import Mesh, Topology, TopologyError, choose_mesh, detect_topology  # noqa: E402

__version__ = "0.1.0"
__all__ = ["STRATEGIES", "Mesh", "SequenceParallelContext", "Topology", "TopologyError",
           "choose_mesh", "detect_topology", "init_sequence_parallel"]
