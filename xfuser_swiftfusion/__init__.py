"""xfuser-swiftfusion: SwiftFusion sequence parallelism for xDiT / xFuser.

    import xfuser_swiftfusion as sf
    ctx = sf.init_sequence_parallel(strategy="swiftfusion", num_heads=H)  # after dist init
    out = ctx.attention(q, k, v)            # [B, H, S_local, D], xFuser's USP contract
    ctx.close()

Layers point one way: the core (``topology`` -> ``mesh`` -> ``groups`` -> ``comm`` ->
``kernels`` -> ``strategies`` -> ``context``) imports nothing of xFuser, diffusers or the CPU
emulation; ``integrations.xfuser`` (``--sp-strategy``, ``USP()`` routing), ``emulation`` (a GPU
cluster on one CPU host) and ``tools`` (the ``swiftfusion`` command) build on it. Importing the
package has no side effects.
"""
from .context import SequenceParallelContext, init_sequence_parallel
from .mesh import Mesh, choose_mesh
from .strategies import names as strategy_names
from .topology import Topology, TopologyError, detect_topology

__version__ = "0.1.0"
__all__ = ["Mesh", "SequenceParallelContext", "Topology", "TopologyError", "choose_mesh",
           "detect_topology", "init_sequence_parallel", "strategy_names"]
