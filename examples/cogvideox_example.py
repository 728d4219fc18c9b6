"""CogVideoX text-to-video with sequence parallelism, xFuser style, any SwiftFusion strategy.

GPU cluster (N machines x M GPUs, a real CogVideoX 1.0 checkpoint directory):

    torchrun --nnodes=N --nproc_per_node=M --node_rank=$NODE --master_addr=$HEAD \\
        examples/cogvideox_example.py --model /ckpt/CogVideoX-5b --sp-strategy swiftfusion \\
        --height 480 --width 720 --num_frames 49 --num_inference_steps 50 --warmup_steps 1 \\
        --prompt "a photo of a cat" --output_type latent

CPU (tiny model with the real architecture, emulated 2 machines x 2 GPUs):

    python examples/cogvideox_example.py --emulate 2x2 --sp-strategy swiftfusion

The flow is xFuser's (``sp_example_common.py`` beside this file). Flags are xFuser's
(``xFuserArgs``) plus ``--sp-strategy {usp,tas,torus,swiftfusion,auto}``,
``--emulate NxM`` and ``--topology NxM``. The last rank prints xFuser's
``epoch time: X sec, parameter memory: P GB, memory: Y GB`` line.
"""
from __future__ import annotations

import functools

from sp_example_common import launch, parse_args, run

from xfuser_swiftfusion.tools.models.parallel import parallelize_cogvideox

KIND = "cogvideox"
CPU_SIZES = dict(height=192, width=64, num_frames=9)  # the tiny checkpoint's video


def save(frames, stem: str) -> str:
    from diffusers.utils import export_to_video
    export_to_video(frames, f"{stem}.mp4", fps=8)
    return f"{stem}.mp4"


def main(argv: list[str] | None = None) -> None:
    args = parse_args("xFuser CogVideoX example with SwiftFusion sequence parallelism",
                      CPU_SIZES, argv)
    launch(KIND, functools.partial(run, KIND, parallelize_cogvideox, save, args.num_frames), args)


if __name__ == "__main__":
    main()
