"""FLUX.1 text-to-image with sequence parallelism, xFuser style, any SwiftFusion strategy.

GPU cluster (N machines x M GPUs, a real FLUX.1 checkpoint directory):

    torchrun --nnodes=N --nproc_per_node=M --node_rank=$NODE --master_addr=$HEAD \\
        examples/flux_example.py --model /ckpt/FLUX.1-dev --sp-strategy swiftfusion \\
        --height 3072 --width 3072 --num_inference_steps 28 --warmup_steps 1 \\
        --prompt "a photo of a cat" --output_type latent

CPU (tiny model with the real architecture, emulated 2 machines x 2 GPUs):

    python examples/flux_example.py --emulate 2x2 --sp-strategy swiftfusion

The flow is xFuser's (``sp_example_common.py`` beside this file). Flags are xFuser's
(``xFuserArgs``) plus ``--sp-strategy {usp,tas,torus,swiftfusion,auto}``,
``--emulate NxM`` and ``--topology NxM``. The last rank prints xFuser's
``epoch time: X sec, parameter memory: P GB, memory: Y GB`` line.
"""
from __future__ import annotations

import functools

from sp_example_common import launch, parse_args, run

from xfuser_swiftfusion.tools.models.parallel import parallelize_flux

KIND = "flux"
CPU_SIZES = dict(height=48, width=48)  # the tiny checkpoint: 9 image tokens per rank on 2x2


def save(image, stem: str) -> str:
    image.save(f"{stem}.png")
    return f"{stem}.png"


def main(argv: list[str] | None = None) -> None:
    args = parse_args("xFuser FLUX.1 example with SwiftFusion sequence parallelism", CPU_SIZES, argv)
    launch(KIND, functools.partial(run, KIND, parallelize_flux, save, 1), args)


if __name__ == "__main__":
    main()
