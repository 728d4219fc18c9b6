"""Wan text-to-video with diffusers' own context parallelism and a SwiftFusion strategy doing
the attention (no xFuser).

The change to a plain diffusers script, on every rank after torch.distributed is up:

    from xfuser_swiftfusion.integrations import diffusers as sfd                        # line 1
    ctxs = [sfd.enable_parallelism(t, strategy="swiftfusion") for t in transformers]     # line 2

``transformers`` is ``[pipe.transformer]`` for Wan 2.1 and also ``pipe.transformer_2`` for
Wan 2.2 A14B. diffusers' ``_cp_plan`` hooks split the video tokens over the ranks and gather
the output; the text stays whole (cross-attention reads it with local queries).

GPU cluster (N machines x M GPUs), a real checkpoint:

    torchrun --nnodes=N --nproc_per_node=M --node_rank=$NODE --master_addr=$HEAD \\
        --master_port=29500 examples/diffusers_wan_example.py \\
        --model Wan-AI/Wan2.1-T2V-14B-Diffusers --strategy swiftfusion \\
        --height 720 --width 1280 --num_frames 81 --steps 50 --save wan.mp4

CPU (tiny random Wan 2.1 built here: 12 heads, real classes; 2 emulated machines x 2 GPUs):

    python examples/diffusers_wan_example.py --emulate 2x2 --strategy swiftfusion

The last rank prints the strategy, its mesh, the latency of the timed generation and, with
``--check`` (default on CPU), the largest difference of the final latents from the same
pipeline run on one device before parallelism is enabled. ``--save`` needs ``imageio``.
"""
from __future__ import annotations

import argparse
import string

import diffusers_example_common as common
import torch
import torch.distributed as dist

# 9 frames of 64 x 64: 3 latent frames of 8 x 8, patches 2 x 2: 48 video tokens
CPU_DEFAULTS = dict(height=64, width=64, num_frames=9, steps=4, max_sequence_length=16)
TINY_TRANSFORMER = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=12,
                        in_channels=16, out_channels=16, text_dim=32, freq_dim=32, ffn_dim=64,
                        num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                        rope_max_seq_len=32)
TINY_VAE = dict(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                temperal_downsample=[False, True, True])
TINY_UMT5 = dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                 relative_attention_num_buckets=8, relative_attention_max_distance=16,
                 dropout_rate=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
WORDS = "a an the of in on cat dog bird city street forest river sky sea night day red blue".split()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = common.parser(__doc__.split("\n")[0],
                      "diffusers Wan checkpoint (hub id or directory); 'tiny' on CPU")
    p.add_argument("--prompt", default="a cat walking along a river at night")
    p.add_argument("--negative_prompt", default="blurry, low quality")
    p.add_argument("--height", type=int, default=480)
    p.add_argument("--width", type=int, default=832)
    p.add_argument("--num_frames", type=int, default=81)
    p.add_argument("--steps", type=int, default=50)
    p.set_defaults(guidance_scale=5.0)
    return common.parse(p, CPU_DEFAULTS, argv)


def tiny_pipeline(seed: int = 0):
    """A Wan 2.1 text-to-video pipeline with random weights: every rank builds the same one."""
    from diffusers import (AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline,
                           WanTransformer3DModel)
    from transformers import T5TokenizerFast, UMT5Config, UMT5EncoderModel
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    vocab += [("\u2581" + w, -3.0) for w in WORDS] + [(c, -5.0) for c in string.ascii_lowercase]
    tokenizer = T5TokenizerFast(vocab=vocab, extra_ids=0, model_max_length=512)
    torch.manual_seed(seed)
    return WanPipeline(
        tokenizer=tokenizer,
        text_encoder=UMT5EncoderModel(UMT5Config(vocab_size=len(vocab), **TINY_UMT5)).eval(),
        vae=AutoencoderKLWan(**TINY_VAE).eval(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
        transformer=WanTransformer3DModel(**TINY_TRANSFORMER).eval())


def load(args: argparse.Namespace, device: torch.device):
    import diffusers
    import transformers
    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
    if args.model == "tiny":
        pipe = tiny_pipeline().to(device)
    else:
        from diffusers import AutoencoderKLWan, WanPipeline
        vae = AutoencoderKLWan.from_pretrained(args.model, subfolder="vae", dtype=torch.float32)
        pipe = WanPipeline.from_pretrained(args.model, vae=vae, dtype=torch.bfloat16).to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def generate(pipe, args: argparse.Namespace, device: torch.device, steps: int):
    """One generation; returns (frames or None, final latents [B, C, F, H, W])."""
    keep_latents, last = common.keep_final_latents()
    out = pipe(args.prompt, negative_prompt=args.negative_prompt, height=args.height,
               width=args.width, num_frames=args.num_frames, num_inference_steps=steps,
               guidance_scale=args.guidance_scale, max_sequence_length=args.max_sequence_length,
               generator=torch.Generator(device).manual_seed(args.seed),
               output_type="np" if args.save else "latent",
               callback_on_step_end=keep_latents, callback_on_step_end_tensor_inputs=["latents"])
    return (out.frames[0] if args.save else None), last["latents"]


def run(args: argparse.Namespace) -> None:
    dev = common.device()
    pipe = load(args, dev)
    transformers = [t for t in (pipe.transformer, pipe.transformer_2) if t is not None]
    result = common.timed_run(pipe, transformers, generate, args, dev)
    if result["output"] is not None and dist.get_rank() == 0:
        from diffusers.utils import export_to_video
        export_to_video(result["output"], args.save, fps=16)
        print(f"saved {args.save}")
    common.report(f"Wan {args.num_frames}x{args.height}x{args.width}, {args.steps} steps", result)


def main(argv: list[str] | None = None) -> None:
    common.launch(run, parse_args(argv))


if __name__ == "__main__":
    main()
