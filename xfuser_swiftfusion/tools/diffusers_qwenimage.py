"""``tiny-qwenimage`` for ``swiftfusion compare-diffusers``: a pipeline whose prompts carry a
text mask.

Qwen-Image's pipeline pads a batch of prompts of different lengths to the longest and passes
a ``[B, L]`` text mask; its transformer joins text and image into one self-attention whose
key-padding mask diffusers' context parallelism shards with the tokens (``encoder_hidden_
states_mask`` in its ``_cp_plan``). ``tiny-qwenimage`` is diffusers' ``QwenImagePipeline``
with a tiny random transformer (24 heads, 2 blocks) and VAE built in memory from a seed, the
same on every rank; no model hub or checkpoint is read. Prompt embeddings are seeded random
tensors standing in for Qwen2.5-VL's output (the text encoder runs before, and outside,
context parallelism): ``prompt_batch`` gives one prompt of ``L`` tokens, or with
``prompt_padding = N`` two prompts, the second ``N`` tokens shorter and padded with zeros
and a masked tail, as the pipeline's encoder pads a batch.
"""
from __future__ import annotations

from typing import Callable

import torch

NAME = "tiny-qwenimage"
KIND = "qwenimage"
HEADS, HEAD_DIM, TEXT_DIM = 24, 16, 32
DEFAULT_SIZE = (64, 64)  # pixels: 8x VAE, 2x2 patches -> 4 x 4 = 16 image tokens
PATCH_PIXELS = 16        # VAE factor 8 x patch 2
TRANSFORMER = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=2,
                   attention_head_dim=HEAD_DIM, num_attention_heads=HEADS,
                   joint_attention_dim=TEXT_DIM, axes_dims_rope=(8, 4, 4))
VAE = dict(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
           temperal_downsample=[False, True, True])
SCHEDULER = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True,
                 base_shift=0.5, max_shift=0.9, base_image_seq_len=256, max_image_seq_len=8192,
                 shift_terminal=0.02, time_shift_type="exponential")


def load(dtype: torch.dtype, device: torch.device, seed: int = 0):
    """The tiny ``QwenImagePipeline`` (no text encoder or tokenizer: prompts come as
    embeddings), its weights drawn from ``torch.manual_seed(seed)``."""
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler,
                           QwenImagePipeline, QwenImageTransformer2DModel)
    torch.manual_seed(seed)
    transformer = QwenImageTransformer2DModel(**TRANSFORMER)
    for p in transformer.parameters():  # zero-initialised gates would hide the attention
        if not p.abs().max():
            torch.nn.init.normal_(p, std=0.02)
    pipe = QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
                             vae=AutoencoderKLQwenImage(**VAE), text_encoder=None,
                             tokenizer=None, transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(device=device, dtype=dtype)


def prompt_batch(tokens: int, prompt_padding: int | None, dtype: torch.dtype,
                 device: torch.device, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt embeddings ``[B, tokens, TEXT_DIM]``, mask ``[B, tokens]`` long, as the
    pipeline's encoder returns them): one prompt (B = 1, all ones: the pipeline drops the
    mask) or, with ``prompt_padding``, two prompts, the second ``prompt_padding`` tokens
    shorter (zeros, mask 0)."""
    g = torch.Generator().manual_seed(seed + 1)
    batch = 1 if prompt_padding is None else 2
    embeds = torch.randn(batch, tokens, TEXT_DIM, generator=g)
    mask = torch.ones(batch, tokens, dtype=torch.long)
    if prompt_padding is not None:
        mask[1, tokens - prompt_padding:] = 0
    embeds[1, tokens - prompt_padding:] = 0
    return embeds.to(device=device, dtype=dtype), mask.to(device)


def generate_latents(pipe, *, height: int, width: int, steps: int, seed: int,
                     max_sequence_length: int, prompt_padding: int | None,
                     on_step: Callable[[int], None] | None = None, **_unused) -> torch.Tensor:
    """One denoising run of the prompt batch: packed latents ``[B, image tokens, 64]``.
    ``on_step(i)`` is called after every step."""
    device = pipe._execution_device
    embeds, mask = prompt_batch(max_sequence_length, prompt_padding, pipe.transformer.dtype,
                                device, seed)
    callback = None
    if on_step is not None:
        def callback(_pipe, i, _t, kwargs):
            on_step(i)
            return kwargs
    gen = torch.Generator(device="cpu").manual_seed(seed)
    out = pipe(prompt_embeds=embeds, prompt_embeds_mask=mask, height=height, width=width,
               num_inference_steps=steps, generator=gen, output_type="latent", true_cfg_scale=1.0,
               callback_on_step_end=callback).images
    return out.to(device)


def check_shapes(height: int, width: int, tokens: int, prompt_padding: int | None,
                 world: int) -> None:
    """``ValueError`` naming the constraint: image and text tokens split evenly over
    ``world`` ranks; the padding leaves the second prompt a token."""
    if height % PATCH_PIXELS or width % PATCH_PIXELS:
        raise ValueError(f"--height/--width must be multiples of {PATCH_PIXELS} for {NAME}")
    image = (height // PATCH_PIXELS) * (width // PATCH_PIXELS)
    if image % world:
        raise ValueError(f"{height}x{width} gives {image} image tokens, not divisible by the "
                         f"{world} ranks")
    if tokens % world:
        raise ValueError(f"--max-sequence-length {tokens}: the plan shards Qwen-Image's text "
                         f"with the image, so it must be a multiple of the {world} ranks")
    if prompt_padding is not None and not 0 < prompt_padding < tokens:
        raise ValueError(f"--prompt-padding {prompt_padding} must be between 1 and "
                         f"--max-sequence-length - 1 = {tokens - 1}")


__all__ = ["DEFAULT_SIZE", "HEADS", "KIND", "NAME", "check_shapes", "generate_latents", "load",
           "prompt_batch"]
