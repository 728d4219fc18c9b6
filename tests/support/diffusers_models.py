"""Every diffusers 0.42 model with a ``_cp_plan``, tiny and random, with the inputs its
pipeline passes: ``build(name, heads, batch)`` -> ``(model, inputs)``.

Masks are the ones each pipeline builds (read from diffusers 0.42's pipelines):

- Qwen-Image: ``encoder_hidden_states_mask`` ``[B, L]`` long, 1 for a prompt's tokens, 0 for
  the padding of a shorter prompt in the batch; None when every entry is 1 (the pipeline
  drops an all-ones mask; ``qwenimage+ones`` passes one, as a direct caller may);
- LTX: the T5 tokenizer's ``prompt_attention_mask`` ``[B, L]`` bool, right-padded to the
  maximum length (batch 2 = classifier-free guidance: the negative and the positive prompt);
- LTX-2: the text connectors' ``[B, L]`` int64 mask for video and audio text: all ones with
  learnable registers (batch 1 here), the left-padded tokenizer mask without (batch 2);
- Flux, FLUX.2, Wan, ChronoEdit, Helios, MiniMax-H3: no mask.

Every sharded length is a multiple of 4 ranks; LTX-2's audio (replicated) has 6 tokens, so
its audio <-> video attention meets another length than the 8 video tokens per rank.
Helios is built with 2 blocks (its plan names blocks 0-39).
"""
from __future__ import annotations

import torch


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(1)


def _lengths_mask(lengths: list[int], total: int, left: bool = False,
                  dtype: torch.dtype = torch.long) -> torch.Tensor:
    """``[B, total]``: 1 on the first (or last, ``left``) ``lengths[b]`` positions of row b."""
    pos = torch.arange(total)
    rows = [(pos >= total - n) if left else (pos < n) for n in lengths]
    return torch.stack(rows).to(dtype)


def flux(heads: int, batch: int):
    """Text (8) and image (16) tokens both sharded: rank i holds [text_i, image_i]."""
    from diffusers import FluxTransformer2DModel
    g, side, text = _gen(), 4, 8
    axis = torch.arange(side).float()
    ids = torch.cartesian_prod(torch.zeros(1), axis, axis)
    model = FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                   attention_head_dim=8, num_attention_heads=heads,
                                   joint_attention_dim=16, pooled_projection_dim=8,
                                   axes_dims_rope=(2, 2, 4))
    return model, dict(hidden_states=torch.randn(batch, side * side, 4, generator=g),
                       encoder_hidden_states=torch.randn(batch, text, 16, generator=g),
                       pooled_projections=torch.randn(batch, 8, generator=g),
                       timestep=torch.linspace(0.5, 0.7, batch), img_ids=ids,
                       txt_ids=torch.zeros(text, 3))


def flux2(heads: int, batch: int):
    """Text (8) and image (16) sharded; 4-axis ids (t, h, w, l)."""
    from diffusers import Flux2Transformer2DModel
    g, side, text = _gen(), 4, 8
    one, axis = torch.arange(1), torch.arange(side)
    img = torch.cartesian_prod(one, axis, axis, one)
    txt = torch.cartesian_prod(one, one, one, torch.arange(text))
    model = Flux2Transformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                    attention_head_dim=16, num_attention_heads=heads,
                                    joint_attention_dim=16, timestep_guidance_channels=32,
                                    axes_dims_rope=(4, 4, 4, 4))
    return model, dict(hidden_states=torch.randn(batch, side * side, 4, generator=g),
                       encoder_hidden_states=torch.randn(batch, text, 16, generator=g),
                       img_ids=img[None].expand(batch, -1, -1),
                       txt_ids=txt[None].expand(batch, -1, -1),
                       timestep=torch.linspace(0.5, 0.7, batch), guidance=torch.ones(batch))


def _wan_like(cls_name: str, heads: int, batch: int):
    """Video (2 x 4 x 4 patches) sharded; text (6) replicated, read by cross-attention only
    (which diffusers calls without the context-parallel config)."""
    import diffusers
    g = _gen()
    model = getattr(diffusers, cls_name)(
        patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=8, in_channels=4,
        out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2, rope_max_seq_len=32)
    return model, dict(hidden_states=torch.randn(batch, 4, 2, 8, 8, generator=g),
                       timestep=torch.full((batch,), 500),
                       encoder_hidden_states=torch.randn(batch, 6, 16, generator=g))


def wan(heads: int, batch: int):
    return _wan_like("WanTransformer3DModel", heads, batch)


def chronoedit(heads: int, batch: int):
    return _wan_like("ChronoEditTransformer3DModel", heads, batch)


def qwenimage(heads: int, batch: int, ones: bool = False):
    """Text (8) and image (16) sharded into one joint self-attention. Batch 2: prompts of 8
    and 5 tokens (the shorter padded, masked); batch 1: no mask, or (``ones``) all ones."""
    from diffusers import QwenImageTransformer2DModel
    g, text = _gen(), 8
    model = QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=2,
                                        attention_head_dim=16, num_attention_heads=heads,
                                        joint_attention_dim=16, axes_dims_rope=(8, 4, 4))
    inputs = dict(hidden_states=torch.randn(batch, 16, 16, generator=g),
                  encoder_hidden_states=torch.randn(batch, text, 16, generator=g),
                  timestep=torch.linspace(0.5, 0.7, batch), img_shapes=[[(1, 4, 4)]] * batch)
    if batch > 1:
        inputs["encoder_hidden_states_mask"] = _lengths_mask([text, 5], text)
    elif ones:
        inputs["encoder_hidden_states_mask"] = _lengths_mask([text], text)
    return model, inputs


def qwenimage_ones(heads: int, batch: int):
    return qwenimage(heads, batch, ones=True)


def ltx(heads: int, batch: int):
    """Video (32) and text (8) sharded: the text cross-attention meets 2 text keys per rank
    (the all-gathered path), masked by the T5 mask (batch 1: 5 tokens; 2: 2 and 6)."""
    from diffusers import LTXVideoTransformer3DModel
    g, frames, side, text = _gen(), 2, 4, 8
    model = LTXVideoTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=heads,
                                       attention_head_dim=8, cross_attention_dim=8 * heads,
                                       num_layers=1, caption_channels=16)
    lengths = [5] if batch == 1 else [2, 6]
    return model, dict(hidden_states=torch.randn(batch, frames * side * side, 4, generator=g),
                       encoder_hidden_states=torch.randn(batch, text, 16, generator=g),
                       timestep=torch.full((batch,), 500),
                       encoder_attention_mask=_lengths_mask(lengths, text, dtype=torch.bool),
                       num_frames=frames, height=side, width=side)


def ltx2(heads: int, batch: int):
    """Video (32) and its text (8) sharded; audio (6) and its text replicated. Batch 1: the
    connectors' all-ones mask; batch 2: left-padded prompts of 3 and 8 tokens."""
    from diffusers import LTX2VideoTransformer3DModel
    g, frames, side, text, audio = _gen(), 2, 4, 8, 6
    model = LTX2VideoTransformer3DModel(
        in_channels=4, out_channels=4, patch_size=1, patch_size_t=1, num_attention_heads=heads,
        attention_head_dim=8, cross_attention_dim=8 * heads, audio_in_channels=4,
        audio_out_channels=4, audio_num_attention_heads=heads, audio_attention_head_dim=4,
        audio_cross_attention_dim=4 * heads, num_layers=1, caption_channels=16,
        rope_double_precision=False)
    mask = _lengths_mask([text] if batch == 1 else [3, text], text, left=True)
    return model, dict(hidden_states=torch.randn(batch, frames * side * side, 4, generator=g),
                       audio_hidden_states=torch.randn(batch, audio, 4, generator=g),
                       encoder_hidden_states=torch.randn(batch, text, 16, generator=g),
                       audio_encoder_hidden_states=torch.randn(batch, text, 16, generator=g),
                       timestep=torch.full((batch,), 500.0), encoder_attention_mask=mask,
                       audio_encoder_attention_mask=mask, num_frames=frames, height=side,
                       width=side, audio_num_frames=audio, fps=25.0)


def minimax_h3_rows(nt: int, na: int, nv: int, height: int, width: int) -> dict:
    """MiniMax-H3's packed-sequence inputs for text ``nt``, audio ``na`` and video ``nv`` rows
    in that order (video on ``height x width`` grids): indices, modality tags, timestep
    indices (audio at the second timestep) and (t, h, w) positions."""
    length = nt + na + nv
    text, audio, video = torch.arange(nt), torch.arange(nt, nt + na), torch.arange(nt + na, length)
    tags = torch.zeros(length, dtype=torch.long)
    tags[text], tags[audio] = 1, 2
    steps = torch.zeros(length, dtype=torch.long)
    steps[audio] = 1
    pos = torch.zeros(length, 3)
    pos[:, 0] = torch.arange(length).float()
    pos[video, 1] = (torch.arange(nv) // width % height).float()
    pos[video, 2] = (torch.arange(nv) % width).float()
    return dict(timestep_indices=steps, token_tags=tags, position_ids=pos, video_indices=video,
                audio_indices=audio, text_indices=text)


def minimax_h3(heads: int, batch: int):
    """One packed sequence: text 4 + audio 4 + video 8 rows, sharded at the first block; the
    text refiner runs before the split (replicated)."""
    from diffusers import MiniMaxH3Transformer3DModel
    g, nt, na, nv = _gen(), 4, 4, 8
    model = MiniMaxH3Transformer3DModel(
        num_attention_heads=heads, attention_head_dim=16, hidden_size=24, num_layers=2,
        num_refiner_layers=1, ffn_dim=32, in_channels=4, audio_in_channels=6,
        patch_size=(1, 2, 2), text_dim=8, freq_dim=8, time_embed_hidden_dim=24,
        time_embed_dim=16, rope_freq_dim=2)
    return model, dict(hidden_states=torch.randn(batch, nv, 16, generator=g),
                       audio_hidden_states=torch.randn(batch, na, 6, generator=g),
                       encoder_hidden_states=torch.randn(batch, nt, 8, generator=g),
                       timestep=torch.tensor([0.7, 0.3]), **minimax_h3_rows(nt, na, nv, 4, 2))


def helios(heads: int, batch: int):
    """2 blocks (its plan names blocks 0-39: trimmed); 128 current + 64 + 16 + 4 history
    tokens."""
    from diffusers import HeliosTransformer3DModel
    g, c, frames, side = _gen(), 4, 2, 16
    model = HeliosTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=heads,
                                     attention_head_dim=12, in_channels=c, out_channels=c,
                                     text_dim=16, freq_dim=32, ffn_dim=32, num_layers=2,
                                     rope_dim=(4, 4, 4))
    hist = (frames - 1, frames - 1, (frames - 1) * 4)
    return model, dict(
        hidden_states=torch.randn(batch, c, frames, side, side, generator=g),
        timestep=torch.full((batch,), 500), encoder_hidden_states=torch.randn(batch, 12, 16, generator=g),
        indices_hidden_states=torch.ones(batch, frames),
        indices_latents_history_short=torch.ones(batch, hist[0]),
        indices_latents_history_mid=torch.ones(batch, hist[1]),
        indices_latents_history_long=torch.ones(batch, hist[2]),
        latents_history_short=torch.randn(batch, c, hist[0], side, side, generator=g),
        latents_history_mid=torch.randn(batch, c, hist[1], side, side, generator=g),
        latents_history_long=torch.randn(batch, c, hist[2], side, side, generator=g))


MODELS = {"flux": flux, "flux2": flux2, "wan": wan, "chronoedit": chronoedit,
          "qwenimage": qwenimage, "qwenimage+ones": qwenimage_ones, "ltx": ltx, "ltx2": ltx2,
          "minimax_h3": minimax_h3, "helios": helios}
# models whose pipeline passes a text mask (all-ones: qwenimage+ones, ltx2 batch 1)
MASKED = {"qwenimage", "qwenimage+ones", "ltx", "ltx2"}


def build(name: str, heads: int, batch: int = 1):
    """``(model in eval mode, inputs)``; zero-initialised parameters are re-drawn (zero gates
    and tables would hide the attention)."""
    torch.manual_seed(0)
    model, inputs = MODELS[name](heads, batch)
    for p in model.parameters():
        if not p.abs().max():
            torch.nn.init.normal_(p, std=0.5)
    return model.eval(), inputs


def forward(model, inputs) -> torch.Tensor:
    """The model's first output, without gradients."""
    with torch.no_grad():
        return model(**inputs, return_dict=False)[0]


__all__ = ["MASKED", "MODELS", "build", "forward", "minimax_h3_rows"]
