"""FLUX.1 text-to-image with diffusers' own context parallelism and a SwiftFusion strategy
doing the attention (no xFuser).

The change to a plain diffusers script, on every rank after torch.distributed is up:

    from xfuser_swiftfusion.integrations import diffusers as sfd            # line 1
    ctx = sfd.enable_parallelism(pipe.transformer, strategy="swiftfusion")   # line 2

diffusers' ``_cp_plan`` hooks split the sequence over the ranks and gather the output; every
rank calls the pipeline with the same prompt and seed and gets the same image.

GPU cluster (N machines x M GPUs), a real checkpoint:

    torchrun --nnodes=N --nproc_per_node=M --node_rank=$NODE --master_addr=$HEAD \\
        --master_port=29500 examples/diffusers_flux_example.py \\
        --model black-forest-labs/FLUX.1-dev --strategy swiftfusion \\
        --height 2048 --width 2048 --steps 28 --save flux.png

CPU (tiny random FLUX.1 with the real architecture, 2 emulated machines x 2 GPUs):

    python examples/diffusers_flux_example.py --emulate 2x2 --strategy swiftfusion

The last rank prints the strategy, its mesh, the latency of the timed generation and, with
``--check`` (default on CPU), the largest difference of the final latents from the same
pipeline run on one device before parallelism is enabled.
"""
from __future__ import annotations

import argparse
import os

import diffusers_example_common as common
import torch
import torch.distributed as dist

CPU_DEFAULTS = dict(height=48, width=48, steps=4, max_sequence_length=16)  # 36 image tokens


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = common.parser(__doc__.split("\n")[0],
                      "diffusers FLUX.1 checkpoint (hub id or directory); 'tiny' on CPU")
    p.add_argument("--prompt", default="a photo of a cat on a red sofa")
    p.add_argument("--height", type=int, default=1024)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--steps", type=int, default=28)
    p.set_defaults(guidance_scale=3.5)
    return common.parse(p, CPU_DEFAULTS, argv)


def load(args: argparse.Namespace, device: torch.device):
    import diffusers
    import transformers
    from diffusers import FluxPipeline
    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
    path = args.model
    if path == "tiny":
        from xfuser_swiftfusion.tools.models.tiny import tiny_checkpoint
        path = tiny_checkpoint("flux")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    pipe = FluxPipeline.from_pretrained(path, dtype=dtype).to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def generate(pipe, args: argparse.Namespace, device: torch.device, steps: int):
    """One generation; returns (output image or None, final packed latents [B, L, C])."""
    keep_latents, last = common.keep_final_latents()
    out = pipe(args.prompt, height=args.height, width=args.width, num_inference_steps=steps,
               guidance_scale=args.guidance_scale, max_sequence_length=args.max_sequence_length,
               generator=torch.Generator(device).manual_seed(args.seed),
               output_type="pil" if args.save else "latent",
               callback_on_step_end=keep_latents, callback_on_step_end_tensor_inputs=["latents"])
    return (out.images[0] if args.save else None), last["latents"]


def run(args: argparse.Namespace) -> None:
    dev = common.device()
    pipe = load(args, dev)
    result = common.timed_run(pipe, [pipe.transformer], generate, args, dev)
    if result["output"] is not None and dist.get_rank() == 0:
        result["output"].save(args.save)
        print(f"saved {args.save}")
    common.report(f"FLUX.1 {args.height}x{args.width}, {args.steps} steps", result)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.model == "tiny" and not os.environ.get("RANK"):  # build the checkpoint before forking
        from xfuser_swiftfusion.tools.models.tiny import tiny_checkpoint
        tiny_checkpoint("flux")
    common.launch(run, args)


if __name__ == "__main__":
    main()
