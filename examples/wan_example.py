"""Wan 2.1 text-to-video with sequence parallelism through xFuser's own Wan wrapper, any
SwiftFusion strategy.

The transformer is xFuser's ``xFuserWanTransformer3DWrapper`` (the class xFuser's Wan runner
loads), with the runner's attention settings; every self-attention goes through xFuser's
``USP``, routed to the strategy.

GPU cluster (N machines x M GPUs, a real Wan 2.1 diffusers checkpoint directory):

    torchrun --nnodes=N --nproc_per_node=M --node_rank=$NODE --master_addr=$HEAD \\
        examples/wan_example.py --model /ckpt/Wan2.1-T2V-14B-Diffusers --sp-strategy swiftfusion \\
        --height 720 --width 1280 --num_frames 81 --num_inference_steps 50 --warmup_steps 1 \\
        --prompt "a cat walking along a river at night" --output_type latent

CPU (tiny model with the real architecture, emulated 2 machines x 2 GPUs):

    python examples/wan_example.py --model tiny-wan --emulate 2x2 --sp-strategy swiftfusion

The flow is xFuser's (``sp_example_common.py`` beside this file). Flags are xFuser's
(``xFuserArgs``) plus ``--sp-strategy {usp,tas,torus,swiftfusion,auto}``,
``--emulate NxM`` and ``--topology NxM``. The video's latent patch count must split evenly
over the ranks. The last rank prints xFuser's
``epoch time: X sec, parameter memory: P GB, memory: Y GB`` line.
"""
from __future__ import annotations

import functools

from sp_example_common import launch, parse_args, run

from xfuser_swiftfusion.tools.models.parallel import parallelize_wan

KIND = "wan"
CPU_SIZES = dict(height=64, width=64, num_frames=9)  # the tiny checkpoint: 48 video tokens


def save(frames, stem: str) -> str:
    from diffusers.utils import export_to_video
    export_to_video(frames, f"{stem}.mp4", fps=16)
    return f"{stem}.mp4"


def main(argv: list[str] | None = None) -> None:
    args = parse_args("xFuser Wan example with SwiftFusion sequence parallelism", CPU_SIZES, argv)
    launch(KIND, functools.partial(run, KIND, parallelize_wan, save, args.num_frames), args)


if __name__ == "__main__":
    main()
