"""FLUX.1 text-to-image with sequence parallelism, xFuser style, any SwiftFusion strategy.

GPU cluster (N machines x M GPUs, a real FLUX.1 checkpoint directory):

    torchrun --nnodes=N --nproc_per_node=M --node_rank=$NODE --master_addr=$HEAD \\
        examples/flux_example.py --model /ckpt/FLUX.1-dev --sp-strategy swiftfusion \\
        --height 3072 --width 3072 --num_inference_steps 28 --warmup_steps 1 \\
        --prompt "a photo of a cat" --output_type latent

CPU (tiny model with the real architecture, emulated 2 machines x 2 GPUs):

    python examples/flux_example.py --emulate 2x2 --sp-strategy swiftfusion

Flags are xFuser's (``xFuserArgs``) plus ``--sp-strategy {usp,tas,torus,swiftfusion,auto}``,
``--emulate NxM`` and ``--topology NxM``. The last rank prints xFuser's
``epoch time: X sec, parameter memory: P GB, memory: Y GB`` line.
"""
from xfuser_swiftfusion.models.parallel import launch_example


def main() -> None:
    launch_example("flux")


if __name__ == "__main__":
    main()
