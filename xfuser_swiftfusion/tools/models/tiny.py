"""Tiny, randomly initialised diffusers checkpoints with the real Flux / CogVideoX / Wan
architectures.

No model hub is reachable on the development machines, so the default model of the examples
and of ``swiftfusion compare`` is written locally: the real transformer classes
(``FluxTransformer2DModel`` with double and single blocks and joint text,
``CogVideoXTransformer3DModel`` with text, ``WanTransformer3DModel`` (Wan 2.1 text-to-video)),
real text encoders (CLIP + T5 for Flux, T5 for CogVideoX, UMT5 for Wan), tokenizers built from
a small vocabulary, real VAEs and schedulers, saved with ``save_pretrained`` so that
``FluxPipeline`` / ``CogVideoXPipeline`` / ``WanPipeline.from_pretrained(path)`` load them
exactly like a real checkpoint.

Invariants:
- 24 attention heads (Ulysses degree ``gcd(N*M, 24)`` works on 2x2, 2x4, 3x2, 4x2, ...);
- fixed seed -> identical bytes (every module is initialised from ``torch.manual_seed(seed)``
  in a fixed order; safetensors and JSON files are deterministic);
- ``tiny_checkpoint(kind)`` caches by a hash of the recipe (configs, seed, library versions)
  under ``$SWIFTFUSION_CACHE`` (default ``~/.cache/xfuser-swiftfusion``).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import string
import tempfile
from pathlib import Path

import torch

from ...log import get_logger

logger = get_logger(__name__)

CACHE_ENV = "SWIFTFUSION_CACHE"
RECIPE_VERSION = 1
KINDS = ("flux", "cogvideox", "wan")
_DONE = ".complete"

HEADS, HEAD_DIM = 24, 16
TEXT_DIM = 32          # T5 d_model = joint_attention_dim / text_embed_dim
CLIP_DIM = 32          # CLIP hidden = pooled_projection_dim
WORDS = ("a an the of and in on with at by over under photo painting video cat dog bird "
         "fish horse city street forest river mountain sky sea beach night day sunset red "
         "blue green yellow white black small large old young running flying sitting").split()

FLUX_TRANSFORMER = dict(patch_size=1, in_channels=16, out_channels=None, num_layers=2,
                        num_single_layers=2, attention_head_dim=HEAD_DIM,
                        num_attention_heads=HEADS, joint_attention_dim=TEXT_DIM,
                        pooled_projection_dim=CLIP_DIM, guidance_embeds=False,
                        axes_dims_rope=(4, 6, 6))
FLUX_VAE = dict(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16),
                layers_per_block=1, latent_channels=4, norm_num_groups=4, sample_size=32,
                scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False,
                use_post_quant_conv=False)
FLUX_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
                      base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                      max_image_seq_len=4096)
COG_TRANSFORMER = dict(num_attention_heads=HEADS, attention_head_dim=HEAD_DIM, in_channels=4,
                       out_channels=4, time_embed_dim=32, text_embed_dim=TEXT_DIM, num_layers=2,
                       sample_width=16, sample_height=48, sample_frames=9, patch_size=2,
                       temporal_compression_ratio=4, max_text_seq_length=226,
                       use_rotary_positional_embeddings=True)
COG_VAE = dict(in_channels=3, out_channels=3,
               down_block_types=("CogVideoXDownBlock3D",) * 3,
               up_block_types=("CogVideoXUpBlock3D",) * 3, block_out_channels=(8, 16, 16),
               latent_channels=4, layers_per_block=1, norm_num_groups=4,
               temporal_compression_ratio=4, sample_height=192, sample_width=64)
COG_SCHEDULER = dict(num_train_timesteps=1000, beta_schedule="scaled_linear",
                     beta_start=0.00085, beta_end=0.012, clip_sample=False,
                     prediction_type="v_prediction", rescale_betas_zero_snr=True,
                     set_alpha_to_one=True, snr_shift_scale=3.0, timestep_spacing="trailing")
WAN_TRANSFORMER = dict(patch_size=(1, 2, 2), num_attention_heads=HEADS, attention_head_dim=HEAD_DIM,
                       in_channels=16, out_channels=16, text_dim=TEXT_DIM, freq_dim=32,
                       ffn_dim=64, num_layers=2, cross_attn_norm=True,
                       qk_norm="rms_norm_across_heads", rope_max_seq_len=32)
# 8x spatial, 4x temporal compression (Wan 2.1's): 9 frames of 64 x 64 -> 3 x 8 x 8 latents
WAN_VAE = dict(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
               temperal_downsample=[False, True, True])
WAN_SCHEDULER = dict(num_train_timesteps=1000, shift=5.0)
T5 = dict(d_model=TEXT_DIM, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
          feed_forward_proj="gated-gelu", relative_attention_num_buckets=8,
          relative_attention_max_distance=16, dropout_rate=0.0, pad_token_id=0,
          eos_token_id=1, decoder_start_token_id=0)
CLIP = dict(hidden_size=CLIP_DIM, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=77, projection_dim=CLIP_DIM,
            bos_token_id=0, eos_token_id=1, pad_token_id=1)


def _clip_tokenizer():
    """Byte-level BPE over single characters (CLIP's format): ``tokenizer.json`` + config."""
    from transformers import CLIPTokenizer
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for suffix in ("", "</w>"):
        for ch in string.ascii_lowercase:
            vocab[ch + suffix] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)


def _t5_tokenizer():
    """Unigram vocabulary of whole words plus single letters (T5's SentencePiece format)."""
    from transformers import T5TokenizerFast
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    vocab += [("\u2581" + w, -3.0) for w in WORDS] + [(c, -5.0) for c in string.ascii_lowercase]
    return T5TokenizerFast(vocab=vocab, extra_ids=0, model_max_length=512)


def _t5_encoder(vocab_size: int):
    from transformers import T5Config, T5EncoderModel
    return T5EncoderModel(T5Config(vocab_size=vocab_size, **T5)).eval()


def _save(pipe, path: str) -> str:
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(str(out), safe_serialization=True)
    return str(out)


def save_tiny_flux(path: str, seed: int = 0) -> str:
    """Write a complete tiny FLUX.1 checkpoint (loadable with ``FluxPipeline.from_pretrained``)."""
    from diffusers import (AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline,
                           FluxTransformer2DModel)
    from transformers import CLIPTextConfig, CLIPTextModel
    torch.manual_seed(seed)
    tok, tok2 = _clip_tokenizer(), _t5_tokenizer()
    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER),
        vae=AutoencoderKL(**FLUX_VAE).eval(),
        text_encoder=CLIPTextModel(CLIPTextConfig(vocab_size=len(tok), **CLIP)).eval(),
        tokenizer=tok,
        text_encoder_2=_t5_encoder(len(tok2)),
        tokenizer_2=tok2,
        transformer=FluxTransformer2DModel(**FLUX_TRANSFORMER).eval(),
    )
    return _save(pipe, path)


def save_tiny_cogvideox(path: str, seed: int = 0) -> str:
    """Write a complete tiny CogVideoX checkpoint (``CogVideoXPipeline.from_pretrained``)."""
    from diffusers import (AutoencoderKLCogVideoX, CogVideoXDDIMScheduler, CogVideoXPipeline,
                           CogVideoXTransformer3DModel)
    torch.manual_seed(seed)
    tok = _t5_tokenizer()
    pipe = CogVideoXPipeline(
        tokenizer=tok,
        text_encoder=_t5_encoder(len(tok)),
        vae=AutoencoderKLCogVideoX(**COG_VAE).eval(),
        transformer=CogVideoXTransformer3DModel(**COG_TRANSFORMER).eval(),
        scheduler=CogVideoXDDIMScheduler(**COG_SCHEDULER),
    )
    return _save(pipe, path)


def save_tiny_wan(path: str, seed: int = 0) -> str:
    """Write a complete tiny Wan 2.1 text-to-video checkpoint (``WanPipeline.from_pretrained``)."""
    from diffusers import (AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline,
                           WanTransformer3DModel)
    from transformers import UMT5Config, UMT5EncoderModel
    torch.manual_seed(seed)
    tok = _t5_tokenizer()
    pipe = WanPipeline(
        tokenizer=tok,
        text_encoder=UMT5EncoderModel(UMT5Config(vocab_size=len(tok), **T5)).eval(),
        vae=AutoencoderKLWan(**WAN_VAE).eval(),
        scheduler=FlowMatchEulerDiscreteScheduler(**WAN_SCHEDULER),
        transformer=WanTransformer3DModel(**WAN_TRANSFORMER).eval(),
    )
    return _save(pipe, path)


_SAVERS = {"flux": save_tiny_flux, "cogvideox": save_tiny_cogvideox, "wan": save_tiny_wan}
_RECIPES = {"flux": (FLUX_TRANSFORMER, FLUX_VAE, FLUX_SCHEDULER, T5, CLIP, WORDS),
            "cogvideox": (COG_TRANSFORMER, COG_VAE, COG_SCHEDULER, T5, WORDS),
            "wan": (WAN_TRANSFORMER, WAN_VAE, WAN_SCHEDULER, T5, WORDS)}


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "xfuser-swiftfusion")


def recipe_hash(kind: str, seed: int = 0) -> str:
    """Hash of everything that determines the checkpoint's bytes."""
    import diffusers
    import transformers
    blob = json.dumps([RECIPE_VERSION, kind, seed, _RECIPES[kind], torch.__version__,
                       diffusers.__version__, transformers.__version__], default=list)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def tiny_checkpoint(kind: str, seed: int = 0) -> str:
    """Path of the cached tiny ``kind`` checkpoint ("flux" | "cogvideox" | "wan"), built on
    first use.

    Built into a temporary sibling directory and renamed into place, so concurrent callers
    never see a half-written checkpoint.
    """
    if kind not in _SAVERS:
        raise ValueError(f"unknown tiny model {kind!r}; choose one of {', '.join(KINDS)}")
    final = cache_dir() / f"tiny-{kind}-{recipe_hash(kind, seed)}"
    if (final / _DONE).exists():
        return str(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=final.name + ".", dir=final.parent))
    try:
        _SAVERS[kind](str(tmp), seed)
        (tmp / _DONE).write_text(recipe_hash(kind, seed))
        try:
            tmp.rename(final)
            logger.info(f"wrote tiny {kind} checkpoint to {final}")
        except OSError:  # another process won the race
            if not (final / _DONE).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(final)


def checkpoint_digest(path: str) -> str:
    """sha256 over every file (relative path + bytes) of a checkpoint directory."""
    h = hashlib.sha256()
    root = Path(path)
    for f in sorted(p for p in root.rglob("*") if p.is_file() and p.name != _DONE):
        h.update(str(f.relative_to(root)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


__all__ = ["save_tiny_flux", "save_tiny_cogvideox", "save_tiny_wan", "tiny_checkpoint", "checkpoint_digest",
           "recipe_hash", "cache_dir", "KINDS", "HEADS"]
