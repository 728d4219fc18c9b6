"""xFuser 0.7.0's own transformer wrappers driven with tiny random diffusers models.

Every family here is one xFuser wrapper class (``xfuser/model_executor/models/transformers``)
set up the way its runner model (``runner_models/*.py``) loads it: ``Wrapper.from_pretrained``
of the diffusers checkpoint with the runner's ``init_kwargs`` (Wan's ``attention_kwargs`` from
``_build_attention_kwargs``), fp32 instead of the runner's bf16. The reference is the plain
diffusers class with the same weights and inputs, run in one process.

    want, path, inputs = prepare("wan", tmp_dir)  # reference saved to tmp_dir, its output
    results = run_emulated(run_cases, "2x2", "wan", cases("wan"), want, path, inputs)

``run_cases`` runs on every emulated rank: per case ``(strategy, ulysses, ring)`` it routes
xFuser's USP to the strategy (``use_strategy``), builds the wrapper from the saved checkpoint
and xFuser's runtime state as the runner does (``DiTRuntimeState`` of the pipeline), runs one
forward and reports the error against ``want`` and ``ctx.stats()``. xFuser's older wrappers
(SD3, PixArt, HunyuanDiT, Latte, CogVideoX, Lumina2) wrap the diffusers model the way their
pipelines do, which also set the input parameters, hand each rank its latent rows (and
text) and all-gather the rows afterwards (``prepare`` / ``gather``).

Sizes: 8 heads x head dim 16, 2 layers, sequences of 16-64 tokens (multiples of the 4 ranks,
so no wrapper pads), text 8 tokens.
"""
from __future__ import annotations

import importlib
import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch

HEADS = 8
STRATEGIES = ("usp", "tas", "torus", "swiftfusion", "auto")
# (strategy, ulysses, ring): 2x2 with the strategy's own mesh (U4xR1 for 8 heads), then U2xR2
# (a ring of two ranks inside each machine)
CASES = tuple((s, None, None) for s in STRATEGIES) + tuple((s, 2, 2) for s in STRATEGIES)
TOPOLOGY = "2x2"


def _gen(seed: int = 1) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _xfuser_args(**kw):
    """xFuser's defaults as the runner would see them (``xFuserArgs`` without flags)."""
    from xfuser.config import xFuserArgs
    return xFuserArgs(model="tiny", **kw)


def _sample(out) -> torch.Tensor:
    sample = out[0] if isinstance(out, (tuple, list)) else out.sample
    if isinstance(sample, (tuple, list)):
        if all(isinstance(t, torch.Tensor) for t in sample):
            return torch.stack(sample)                     # Z-Image: one tensor per image
        return sample[0]                                   # SD3 wrapper: (sample, None)
    return sample


@dataclass(frozen=True)
class Family:
    """One xFuser wrapper and the tiny diffusers model it wraps.

    ``build()`` -> (reference model, forward kwargs), seeded. ``wrapper``: ``module:Class``
    (or ``module:factory()``) under ``xfuser.model_executor.models.transformers``. ``init_kwargs()``: what the runner
    passes to ``from_pretrained``. ``prepare(model, inputs)``: runtime settings the runner or
    pipeline makes before the forward; it may return this rank's inputs (xFuser's older
    pipelines shard the text before the transformer). ``wraps``: the wrapper takes the
    diffusers model (xFuser's older pipeline wrappers); ``gather``: the all-gather its
    pipeline does after the transformer. ``select``: the compared part of the output.
    ``ring``: the runner allows ``--ring_degree > 1``. ``pipeline``: the class name
    ``DiTRuntimeState`` sees. ``config_hidden``: see ``parallel``. ``return_dict``: the
    wrapper's forward takes it.
    """
    name: str
    runner: str
    wrapper: str
    build: Callable[[], tuple[torch.nn.Module, dict]]
    init_kwargs: Callable[[], dict] = dict
    prepare: Callable[[torch.nn.Module, dict], dict | None] | None = None
    pipeline: str = "DiffusionPipeline"
    select: Callable[[torch.Tensor, dict], torch.Tensor] | None = None
    config_hidden: bool = False
    wraps: bool = False
    return_dict: bool = True
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None
    ring: bool = True
    heads: int = HEADS

    def wrapper_class(self):
        module, cls = self.wrapper.split(":")
        mod = importlib.import_module(f"xfuser.model_executor.models.transformers.{module}")
        if cls.endswith("()"):  # a factory: xFuser builds the class on first use
            return getattr(mod, cls[:-2])()
        return getattr(mod, cls)

    def output(self, out, inputs: dict) -> torch.Tensor:
        """The compared part of a forward's output (``select``: e.g. image rows only)."""
        sample = _sample(out)
        return self.select(sample, inputs) if self.select else sample

    def reference(self, ref: torch.nn.Module, inputs: dict) -> torch.Tensor:
        """The single-device forward of the plain diffusers model."""
        with torch.no_grad():
            return self.output(ref(**inputs, return_dict=False), inputs).detach().clone()

    def call(self, model: torch.nn.Module, inputs: dict):
        """``model(**inputs)`` as a tuple (``return_dict=False`` where the wrapper takes it)."""
        return model(**inputs, return_dict=False) if self.return_dict else model(**inputs)

    def parallel(self, path: str) -> torch.nn.Module:
        """The wrapper loaded from the saved reference checkpoint, as the runner loads it."""
        cls = self.wrapper_class()
        if self.wraps:  # xFuser's older wrappers take the diffusers model (its pipelines do)
            from diffusers import AutoModel
            return cls(AutoModel.from_pretrained(path, torch_dtype=torch.float32).eval()).eval()
        if not self.config_hidden:
            return cls.from_pretrained(path, torch_dtype=torch.float32,
                                       **self.init_kwargs()).eval()
        # xFuser bug: the wrapper's __init__(*args, **kwargs) hides the config from diffusers'
        # from_config, so from_pretrained builds the class defaults (the official checkpoint's
        # sizes) and fails on any other config: construct with the config, then load.
        from safetensors.torch import load_file
        config = {k: v for k, v in cls.load_config(path).items() if not k.startswith("_")}
        model = cls(**config, **self.init_kwargs())
        model.load_state_dict(load_file(f"{path}/diffusion_pytorch_model.safetensors"),
                              strict=True)
        return model.eval()


# ---------------------------------------------------------------------------------------------
# tiny models
# ---------------------------------------------------------------------------------------------

def _wan():
    from diffusers import WanTransformer3DModel
    torch.manual_seed(0)
    model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=HEADS,
                                  attention_head_dim=16, in_channels=4, out_channels=4,
                                  text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2,
                                  rope_max_seq_len=32).eval()
    g = _gen()
    return model, dict(hidden_states=torch.randn(1, 4, 2, 8, 8, generator=g),   # 32 tokens
                       timestep=torch.tensor([500]),
                       encoder_hidden_states=torch.randn(1, 6, 16, generator=g))


def _wan_kwargs() -> dict:
    from xfuser.model_executor.models.runner_models.wan import _build_attention_kwargs
    return {"attention_kwargs": _build_attention_kwargs(_xfuser_args())}


def _flux():
    from diffusers import FluxTransformer2DModel
    torch.manual_seed(0)
    side, text = 4, 8
    model = FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                   attention_head_dim=16, num_attention_heads=HEADS,
                                   joint_attention_dim=16, pooled_projection_dim=8,
                                   axes_dims_rope=(4, 6, 6)).eval()
    g = _gen()
    axis = torch.arange(side).float()
    return model, dict(hidden_states=torch.randn(1, side * side, 4, generator=g),
                       encoder_hidden_states=torch.randn(1, text, 16, generator=g),
                       pooled_projections=torch.randn(1, 8, generator=g),
                       timestep=torch.tensor([0.5]),
                       img_ids=torch.cartesian_prod(torch.zeros(1), axis, axis),
                       txt_ids=torch.zeros(text, 3))


def _flux_prepare(model, inputs) -> None:
    from xfuser.core.distributed import get_runtime_state
    get_runtime_state().max_condition_sequence_length = inputs["encoder_hidden_states"].shape[1]


def _flux2():
    from diffusers import Flux2Transformer2DModel
    torch.manual_seed(0)
    side, text = 4, 8
    one, axis = torch.arange(1), torch.arange(side)
    model = Flux2Transformer2DModel(patch_size=1, in_channels=4, num_layers=1,
                                    num_single_layers=1, attention_head_dim=16,
                                    num_attention_heads=HEADS, joint_attention_dim=16,
                                    timestep_guidance_channels=32,
                                    axes_dims_rope=(4, 4, 4, 4)).eval()
    g = _gen()
    return model, dict(hidden_states=torch.randn(1, side * side, 4, generator=g),
                       encoder_hidden_states=torch.randn(1, text, 16, generator=g),
                       img_ids=torch.cartesian_prod(one, axis, axis, one)[None],
                       txt_ids=torch.cartesian_prod(one, one, one, torch.arange(text))[None],
                       timestep=torch.tensor([0.5]), guidance=torch.tensor([1.0]))


def _qwen():
    from diffusers import QwenImageTransformer2DModel
    torch.manual_seed(0)
    model = QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4,
                                        num_layers=2, attention_head_dim=16,
                                        num_attention_heads=HEADS, joint_attention_dim=16,
                                        axes_dims_rope=(8, 4, 4)).eval()
    g, text = _gen(), 8
    return model, dict(hidden_states=torch.randn(1, 16, 16, generator=g),
                       encoder_hidden_states=torch.randn(1, text, 16, generator=g),
                       encoder_hidden_states_mask=torch.ones(1, text, dtype=torch.long),
                       timestep=torch.tensor([0.5]), img_shapes=[(1, 4, 4)])


def _hunyuan_video():
    from diffusers import HunyuanVideoTransformer3DModel
    torch.manual_seed(0)
    model = HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=HEADS, attention_head_dim=16,
        num_layers=1, num_single_layers=1, num_refiner_layers=1, mlp_ratio=2.0, patch_size=2,
        patch_size_t=1, guidance_embeds=True, text_embed_dim=16, pooled_projection_dim=8,
        rope_axes_dim=(4, 6, 6)).eval()
    g, text = _gen(), 8
    return model, dict(hidden_states=torch.randn(1, 4, 2, 8, 8, generator=g),   # 32 tokens
                       timestep=torch.tensor([500]),
                       encoder_hidden_states=torch.randn(1, text, 16, generator=g),
                       encoder_attention_mask=torch.ones(1, text, dtype=torch.long),
                       pooled_projections=torch.randn(1, 8, generator=g),
                       guidance=torch.tensor([3500.0]))


def _hunyuan_video15():
    from diffusers import HunyuanVideo15Transformer3DModel
    torch.manual_seed(0)
    model = HunyuanVideo15Transformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=HEADS, attention_head_dim=16,
        num_layers=2, num_refiner_layers=1, mlp_ratio=2.0, patch_size=1, patch_size_t=1,
        text_embed_dim=16, text_embed_2_dim=8, image_embed_dim=8, rope_axes_dim=(4, 6, 6),
        target_size=64, task_type="i2v").eval()
    g = _gen()
    return model, dict(hidden_states=torch.randn(1, 4, 2, 4, 4, generator=g),   # 32 tokens
                       timestep=torch.tensor([500.0]),
                       encoder_hidden_states=torch.randn(1, 8, 16, generator=g),
                       encoder_attention_mask=torch.ones(1, 8, dtype=torch.long),
                       encoder_hidden_states_2=torch.randn(1, 4, 8, generator=g),
                       encoder_attention_mask_2=torch.ones(1, 4, dtype=torch.long),
                       image_embeds=torch.randn(1, 4, 8, generator=g))


def _z_image():
    from diffusers import ZImageTransformer2DModel
    torch.manual_seed(0)
    model = ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=HEADS * 16, n_layers=2,
        n_refiner_layers=1, n_heads=HEADS, n_kv_heads=HEADS, cap_feat_dim=16,
        axes_dims=[4, 6, 6], axes_lens=[64, 32, 32]).eval()
    g = _gen()
    return model, dict(x=[torch.randn(4, 1, 8, 8, generator=g)],                 # 16 tokens
                       t=torch.tensor([0.5]), cap_feats=[torch.randn(8, 16, generator=g)])


def _ltx2():
    from diffusers import LTX2VideoTransformer3DModel
    torch.manual_seed(0)
    frames, side, text, audio = 2, 4, 8, 8
    model = LTX2VideoTransformer3DModel(
        in_channels=4, out_channels=4, patch_size=1, patch_size_t=1, num_attention_heads=HEADS,
        attention_head_dim=16, cross_attention_dim=16 * HEADS, audio_in_channels=4,
        audio_out_channels=4, audio_num_attention_heads=HEADS, audio_attention_head_dim=8,
        audio_cross_attention_dim=8 * HEADS, num_layers=2, caption_channels=16,
        rope_double_precision=False, rope_type="split").eval()
    g = _gen()
    return model, dict(hidden_states=torch.randn(1, frames * side * side, 4, generator=g),
                       audio_hidden_states=torch.randn(1, audio, 4, generator=g),
                       encoder_hidden_states=torch.randn(1, text, 16, generator=g),
                       audio_encoder_hidden_states=torch.randn(1, text, 16, generator=g),
                       timestep=torch.tensor([500.0]), num_frames=frames,
                       height=side, width=side, audio_num_frames=audio, fps=25.0)


def _minimax_h3():
    from diffusers import MiniMaxH3Transformer3DModel
    torch.manual_seed(0)
    from .diffusers_models import minimax_h3_rows
    nt, na, nv = 8, 8, 48       # 64 rows: a multiple of the wrapper's alignment (no pad rows)
    model = MiniMaxH3Transformer3DModel(
        num_attention_heads=HEADS, attention_head_dim=16, hidden_size=32, num_layers=2,
        num_refiner_layers=1, ffn_dim=32, in_channels=4, audio_in_channels=6,
        patch_size=(1, 2, 2), text_dim=8, freq_dim=8, time_embed_hidden_dim=32,
        time_embed_dim=16, rope_freq_dim=2).eval()
    g = _gen()
    return model, dict(hidden_states=torch.randn(1, nv, 16, generator=g),
                       audio_hidden_states=torch.randn(1, na, 6, generator=g),
                       encoder_hidden_states=torch.randn(1, nt, 8, generator=g),
                       timestep=torch.tensor([0.7, 0.3]), **minimax_h3_rows(nt, na, nv, 4, 4))


def _krea2():
    from diffusers.models.transformers.transformer_krea2 import Krea2Transformer2DModel
    torch.manual_seed(0)
    model = Krea2Transformer2DModel(
        in_channels=16, num_layers=2, attention_head_dim=16, num_attention_heads=HEADS,
        num_key_value_heads=2, intermediate_size=32, timestep_embed_dim=16, text_hidden_dim=16,
        num_text_layers=2, text_num_attention_heads=2, text_num_key_value_heads=2,
        text_intermediate_size=32, num_layerwise_text_blocks=1, num_refiner_text_blocks=1,
        axes_dims_rope=(4, 6, 6)).eval()
    g, text, side = _gen(), 8, 4
    axis = torch.arange(side).float()
    pos = torch.cat([torch.stack([torch.arange(text).float(), torch.zeros(text),
                                  torch.zeros(text)], -1),
                     torch.cartesian_prod(torch.full((1,), float(text)), axis, axis)])
    # the pipeline's prompt mask: the last 3 text tokens are padding
    return model, dict(hidden_states=torch.randn(1, side * side, 16, generator=g),
                       encoder_hidden_states=torch.randn(1, text, 2, 16, generator=g),
                       timestep=torch.tensor([0.5]), position_ids=pos,
                       encoder_attention_mask=(torch.arange(text) < text - 3)[None])


def _wan_vace():
    from diffusers import WanVACETransformer3DModel
    torch.manual_seed(0)
    model = WanVACETransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=HEADS, attention_head_dim=16, in_channels=4,
        out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2,
        rope_max_seq_len=32, vace_layers=[0], vace_in_channels=8).eval()
    g = _gen()
    return model, dict(hidden_states=torch.randn(1, 4, 2, 8, 8, generator=g),   # 32 tokens
                       timestep=torch.tensor([500]),
                       encoder_hidden_states=torch.randn(1, 6, 16, generator=g),
                       control_hidden_states=torch.randn(1, 8, 2, 8, 8, generator=g),
                       control_hidden_states_scale=torch.ones(1))


def _ideogram4():
    from diffusers import Ideogram4Transformer2DModel
    torch.manual_seed(0)
    model = Ideogram4Transformer2DModel(
        in_channels=16, num_layers=2, attention_head_dim=16, num_attention_heads=HEADS,
        intermediate_size=32, adaln_dim=16, llm_features_dim=16,
        mrope_section=(4, 2, 2)).eval()
    g, text, side = _gen(), 8, 4
    length = text + side * side
    axis = torch.arange(side)
    pos = torch.cat([torch.arange(text)[:, None].expand(text, 3),
                     65536 + torch.cartesian_prod(torch.zeros(1, dtype=torch.long), axis, axis)])
    indicator = torch.cat([torch.full((text,), 3), torch.full((side * side,), 2)])
    return model, dict(hidden_states=torch.randn(1, length, 16, generator=g),
                       timestep=torch.tensor([0.5]),
                       encoder_hidden_states=torch.randn(1, length, 16, generator=g),
                       position_ids=pos[None], segment_ids=torch.zeros(1, length, dtype=torch.long),
                       indicator=indicator[None])


def _sd3():
    from diffusers import SD3Transformer2DModel
    torch.manual_seed(0)
    model = SD3Transformer2DModel(sample_size=16, patch_size=2, in_channels=4, num_layers=2,
                                  attention_head_dim=16, num_attention_heads=HEADS,
                                  joint_attention_dim=16, caption_projection_dim=HEADS * 16,
                                  pooled_projection_dim=8, out_channels=4,
                                  pos_embed_max_size=16).eval()
    g = _gen()
    return model, dict(hidden_states=torch.randn(1, 4, 16, 16, generator=g),   # 64 patches
                       encoder_hidden_states=torch.randn(1, 8, 16, generator=g),
                       pooled_projections=torch.randn(1, 8, generator=g),
                       timestep=torch.tensor([500.0]))


def _rows_prepare(model, inputs, split_text: bool = False) -> dict:
    """xFuser's older pipelines (``__call__`` + ``_init_sync_pipeline`` /
    ``_init_video_sync_pipeline``): input parameters in pixels, unpatched mode, this SP rank's
    latent rows (``pp_patches_start_end_idx_global``); SD3 also shards the text."""
    from xfuser.core.distributed import (get_runtime_state, get_sequence_parallel_rank,
                                         get_sequence_parallel_world_size)
    state = get_runtime_state()
    latents = inputs["hidden_states"]                  # [B, C, H, W] or [B, C, F, H, W]
    h, w = latents.shape[-2:]
    state.set_input_parameters(height=h * 8, width=w * 8, batch_size=1, num_inference_steps=1,
                               split_text_embed_in_sp=split_text)
    state.set_patched_mode(patch_mode=False)
    latents = torch.cat([latents[..., a:b, :] for a, b in state.pp_patches_start_end_idx_global],
                        dim=-2)
    out = dict(inputs, hidden_states=latents)
    if split_text:
        text = inputs["encoder_hidden_states"]
        world = get_sequence_parallel_world_size()
        assert text.shape[1] % world == 0
        out["encoder_hidden_states"] = text.chunk(world, dim=1)[get_sequence_parallel_rank()]
    return out


def _sd3_prepare(model, inputs) -> dict:
    return _rows_prepare(model, inputs, split_text=True)


def _pixart():
    from diffusers import PixArtTransformer2DModel
    torch.manual_seed(0)
    model = PixArtTransformer2DModel(
        num_attention_heads=HEADS, attention_head_dim=16, in_channels=4, out_channels=8,
        num_layers=2, cross_attention_dim=HEADS * 16, sample_size=16, patch_size=2,
        caption_channels=16, use_additional_conditions=False).eval()
    g = _gen()
    return model, dict(hidden_states=torch.randn(1, 4, 16, 16, generator=g),   # 64 patches
                       encoder_hidden_states=torch.randn(1, 8, 16, generator=g),
                       timestep=torch.tensor([500]),
                       added_cond_kwargs={"resolution": None, "aspect_ratio": None})


def _hunyuan_dit():
    from diffusers import HunyuanDiT2DModel
    from diffusers.models.embeddings import get_2d_rotary_pos_embed
    from diffusers.pipelines.hunyuandit.pipeline_hunyuandit import (
        get_resize_crop_region_for_grid)
    torch.manual_seed(0)
    model = HunyuanDiT2DModel(
        num_attention_heads=HEADS, attention_head_dim=16, in_channels=4, patch_size=2,
        sample_size=16, hidden_size=HEADS * 16, num_layers=2, mlp_ratio=2.0,
        cross_attention_dim=16, cross_attention_dim_t5=16, pooled_projection_dim=16,
        text_len=8, text_len_t5=8).eval()
    g, grid = _gen(), 8                                  # 128 x 128 px: 8 x 8 patches
    rope = get_2d_rotary_pos_embed(16, get_resize_crop_region_for_grid((grid, grid), 32),
                                   (grid, grid))          # the pipeline's, base size 512 px
    return model, dict(hidden_states=torch.randn(1, 4, 16, 16, generator=g),
                       timestep=torch.tensor([500.0]),
                       encoder_hidden_states=torch.randn(1, 8, 16, generator=g),
                       text_embedding_mask=torch.ones(1, 8, dtype=torch.long),
                       encoder_hidden_states_t5=torch.randn(1, 8, 16, generator=g),
                       text_embedding_mask_t5=torch.ones(1, 8, dtype=torch.long),
                       image_meta_size=torch.tensor([[128.0, 128, 128, 128, 0, 0]]),
                       style=torch.tensor([0]), image_rotary_emb=rope)


def _hunyuan_dit_prepare(model, inputs) -> dict:
    """xFuserHunyuanDiTPipeline._init_sync_pipeline: this rank's rows and their RoPE rows."""
    from xfuser.core.distributed import get_runtime_state
    out = _rows_prepare(model, inputs)
    spans = get_runtime_state().pp_patches_token_start_end_idx_global
    out["image_rotary_emb"] = tuple(torch.cat([f[a:b] for a, b in spans], dim=0)
                                    for f in inputs["image_rotary_emb"])
    return out


def _cogvideox():
    from diffusers import CogVideoXTransformer3DModel
    torch.manual_seed(0)
    model = CogVideoXTransformer3DModel(
        num_attention_heads=HEADS, attention_head_dim=16, in_channels=4, out_channels=4,
        time_embed_dim=16, text_embed_dim=16, num_layers=2, sample_width=8, sample_height=8,
        sample_frames=5, patch_size=2, temporal_compression_ratio=4, max_text_seq_length=8,
        use_rotary_positional_embeddings=False).eval()
    g = _gen()
    return model, dict(hidden_states=torch.randn(1, 2, 4, 8, 8, generator=g),  # 2 x 4 x 4 patches
                       encoder_hidden_states=torch.randn(1, 8, 16, generator=g),
                       timestep=torch.tensor([500]))


def _cogvideox_prepare(model, inputs) -> dict:
    """xFuserCogVideoXPipeline.__call__ + _init_sync_pipeline: video input parameters, this
    rank's latent rows, the text sharded (divisible here)."""
    from xfuser.core.distributed import (get_runtime_state, get_sequence_parallel_rank,
                                         get_sequence_parallel_world_size)
    state = get_runtime_state()
    latents = inputs["hidden_states"]                  # [B, F, C, H, W]
    frames, h, w = latents.shape[1], *latents.shape[-2:]
    state.set_video_input_parameters(height=h * 8, width=w * 8, num_frames=(frames - 1) * 4 + 1,
                                     batch_size=1, num_inference_steps=1,
                                     split_text_embed_in_sp=True)
    state.set_patched_mode(patch_mode=False)
    latents = torch.cat([latents[..., a:b, :] for a, b in state.pp_patches_start_end_idx_global],
                        dim=-2)
    world, text = get_sequence_parallel_world_size(), inputs["encoder_hidden_states"]
    assert text.shape[1] % world == 0
    return dict(inputs, hidden_states=latents,
                encoder_hidden_states=text.chunk(world, dim=1)[get_sequence_parallel_rank()])


def _gather_video_rows(out: torch.Tensor) -> torch.Tensor:
    """xFuserCogVideoXPipeline: ``get_sp_group().all_gather(latents, dim=-2)``."""
    from xfuser.core.distributed import get_sp_group
    return get_sp_group().all_gather(out.contiguous(), dim=-2)


def _cosmos3():
    from diffusers.models.transformers.transformer_cosmos3 import Cosmos3OmniTransformer
    torch.manual_seed(0)
    model = Cosmos3OmniTransformer(
        head_dim=16, hidden_size=HEADS * 16, intermediate_size=64, latent_channel=4,
        latent_patch_size=2, num_attention_heads=HEADS, num_hidden_layers=2,
        num_key_value_heads=HEADS, patch_latent_dim=16, vocab_size=64).eval()
    g, text, image = _gen(), 8, 16                     # causal text prefix + 4 x 4 patches
    pos = torch.zeros(3, text + image, dtype=torch.long)   # mRoPE (t, h, w)
    pos[:, :text] = torch.arange(text)
    pos[0, text:] = text
    pos[1, text:] = text + torch.arange(image) // 4
    pos[2, text:] = text + torch.arange(image) % 4
    vision = torch.arange(text, text + image)
    return model, dict(input_ids=torch.randint(0, 64, (text,), generator=g),
                       text_indexes=torch.arange(text), position_ids=pos, und_len=text,
                       sequence_length=text + image,
                       vision_tokens=[torch.randn(4, 1, 8, 8, generator=g)],
                       vision_token_shapes=[(1, 4, 4)], vision_sequence_indexes=vision,
                       vision_mse_loss_indexes=vision,
                       vision_timesteps=torch.full((image,), 500.0),
                       vision_noisy_frame_indexes=[torch.tensor([0])])


LATTE_TEMPORAL = True


def _latte():
    from diffusers import LatteTransformer3DModel
    torch.manual_seed(0)
    model = LatteTransformer3DModel(
        num_attention_heads=HEADS, attention_head_dim=16, in_channels=4, out_channels=8,
        num_layers=2, cross_attention_dim=HEADS * 16, sample_size=16, patch_size=2,
        activation_fn="gelu-approximate", num_embeds_ada_norm=1000, norm_type="ada_norm_single",
        norm_elementwise_affine=False, norm_eps=1e-6, caption_channels=16,
        video_length=2).eval()
    g = _gen()
    return model, dict(hidden_states=torch.randn(1, 4, 2, 16, 16, generator=g),
                       encoder_hidden_states=torch.randn(1, 8, 16, generator=g),
                       timestep=torch.tensor([500]), enable_temporal_attentions=LATTE_TEMPORAL)


def _gather_rows(out: torch.Tensor) -> torch.Tensor:
    """The pipeline's all-gather of every SP rank's latent rows ([B, C, H/W, W])."""
    from xfuser.core.distributed import get_sp_group
    return torch.cat(get_sp_group().all_gather(out.contiguous(), separate_tensors=True), dim=-2)


def _lumina2():
    from diffusers import Lumina2Transformer2DModel
    torch.manual_seed(0)
    model = Lumina2Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, hidden_size=HEADS * 16, num_layers=2,
        num_refiner_layers=1, num_attention_heads=HEADS, num_kv_heads=4, multiple_of=16,
        axes_dim_rope=(4, 6, 6), axes_lens=(64, 32, 32), cap_feat_dim=16).eval()
    g = _gen()
    # 8 text + 16 image tokens: a multiple of 4, no SP padding, so no mask
    return model, dict(hidden_states=torch.randn(1, 4, 8, 8, generator=g),
                       timestep=torch.tensor([0.5]),
                       encoder_hidden_states=torch.randn(1, 8, 16, generator=g),
                       encoder_attention_mask=torch.ones(1, 8, dtype=torch.bool))


def _ideogram4_prepare(model, inputs) -> None:
    model._init_sp_state()   # the runner's _post_load_and_state_initialization


def _image_rows(out: torch.Tensor, inputs: dict) -> torch.Tensor:
    """Ideogram-4: only the rows tagged OUTPUT_IMAGE_INDICATOR (2) are predictions."""
    return out[:, inputs["indicator"][0] == 2]


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("wan", "Wan2.1-T2V / Wan2.2-T2V (runner_models/wan.py)",
           "transformer_wan:xFuserWanTransformer3DWrapper", _wan, init_kwargs=_wan_kwargs,
           pipeline="WanPipeline"),
    Family("flux", "FLUX.1-dev / Kontext (runner_models/flux.py)",
           "transformer_flux:xFuserFlux1Transformer2DWrapper", _flux, prepare=_flux_prepare,
           pipeline="FluxPipeline"),
    Family("flux2", "FLUX.2-dev / klein (runner_models/flux.py)",
           "transformer_flux2:xFuserFlux2Transformer2DWrapper", _flux2,
           pipeline="Flux2Pipeline"),
    Family("qwen-image", "Qwen-Image (runner_models/qwen.py)",
           "transformer_qwen:xFuserQwenImageTransformerWrapper", _qwen,
           pipeline="QwenImagePipeline"),
    Family("hunyuan-video", "HunyuanVideo (runner_models/hunyuan.py)",
           "transformer_hunyuan_video:xFuserHunyuanVideoTransformer3DWrapper", _hunyuan_video,
           pipeline="HunyuanVideoPipeline"),
    Family("hunyuan-video-1.5", "HunyuanVideo-1.5 (+ Distilled) (runner_models/hunyuan.py)",
           "transformer_hunyuan_video15:xFuserHunyuanVideo15Transformer3DWrapper",
           _hunyuan_video15, pipeline="HunyuanVideo15ImageToVideoPipeline"),
    Family("z-image", "Z-Image (runner_models/z_image.py)",
           "transformer_z_image:xFuserZImageTransformer2DWrapper", _z_image,
           pipeline="ZImagePipeline", config_hidden=True),
    Family("ltx-2", "LTX-2 (runner_models/ltx.py)",
           "transformer_ltx2:xFuserLTX2VideoTransformer3DWrapper", _ltx2,
           pipeline="LTX2Pipeline"),
    Family("minimax-h3", "MiniMax-H3 (runner_models/minimax_h3.py)",
           "transformer_minimax_h3:xFuserMiniMaxH3Transformer3DWrapper", _minimax_h3,
           pipeline="MiniMaxH3Pipeline", ring=False),
    Family("krea-2", "Krea-2 Raw / Turbo (runner_models/krea2.py)",
           "transformer_krea2:xFuserKrea2Transformer2DWrapper", _krea2,
           pipeline="Krea2Pipeline", config_hidden=True, ring=False),
    Family("wan-vace", "Wan2.1-VACE (runner_models/wan.py)",
           "transformer_wan_vace:xFuserWanVACETransformer3DWrapper", _wan_vace,
           pipeline="WanVACEPipeline"),
    Family("ideogram-4", "Ideogram-4 (runner_models/ideogram4.py)",
           "transformer_ideogram4:get_ideogram4_transformer_wrapper_class()", _ideogram4,
           pipeline="Ideogram4Pipeline", select=_image_rows,
           prepare=_ideogram4_prepare),
    Family("cosmos3", "Cosmos3-Super / Nano (runner_models/cosmos3.py)",
           "transformer_cosmos3:get_cosmos3_transformer_wrapper_class()", _cosmos3,
           pipeline="Cosmos3OmniPipeline", return_dict=False),
    Family("sd3", "SD3.5 (runner_models/stable_diffusion.py)",
           "transformer_sd3:xFuserSD3Transformer2DWrapper", _sd3, wraps=True,
           prepare=_sd3_prepare, gather=_gather_rows, pipeline="xFuserStableDiffusion3Pipeline"),
    Family("pixart", "PixArt-alpha / Sigma (xFuser's examples; no runner)",
           "pixart_transformer_2d:xFuserPixArtTransformer2DWrapper", _pixart, wraps=True,
           prepare=_rows_prepare, gather=_gather_rows, pipeline="xFuserPixArtAlphaPipeline"),
    Family("cogvideox", "CogVideoX (xFuser's pipeline / examples; no runner)",
           "cogvideox_transformer_3d:xFuserCogVideoXTransformer3DWrapper", _cogvideox,
           wraps=True, prepare=_cogvideox_prepare, gather=_gather_video_rows,
           pipeline="CogVideoXPipeline"),
    Family("hunyuan-dit", "HunyuanDiT (xFuser's examples; no runner)",
           "hunyuan_transformer_2d:xFuserHunyuanDiT2DWrapper", _hunyuan_dit, wraps=True,
           prepare=_hunyuan_dit_prepare, gather=_gather_rows, pipeline="xFuserHunyuanDiTPipeline"),
    Family("latte", "Latte (xFuser's examples; no runner)",
           "latte_transformer_3d:xFuserLatteTransformer3DWrapper", _latte, wraps=True,
           prepare=_rows_prepare, gather=_gather_rows, pipeline="xFuserLattePipeline"),
    Family("lumina2", "Lumina-Image-2.0 (runner_models/lumina2.py)",
           "transformer_lumina2:xFuserLumina2Transformer2DWrapper", _lumina2, wraps=True,
           pipeline="xFuserLumina2Pipeline", ring=False),
)}


# ---------------------------------------------------------------------------------------------
# on every emulated rank
# ---------------------------------------------------------------------------------------------

class _Pipe:
    """What ``DiTRuntimeState`` reads of the runner's pipeline (its class name picks the
    model-parameter branch; diffusers' VAE factors: 8 spatial, 4 temporal)."""
    vae_scale_factor = vae_scale_factor_spatial = 8
    vae_scale_factor_temporal = 4

    def __init__(self, transformer: torch.nn.Module) -> None:
        self.transformer = transformer


def runner_runtime_state(pipeline: str, transformer: torch.nn.Module) -> None:
    """xFuser's runtime state as the runner builds it (``initialize_runtime_state(pipe,
    engine_config)`` -> ``DiTRuntimeState``), on the groups ``use_strategy`` set up, for a
    pipeline of class name ``pipeline`` holding ``transformer``."""
    from xfuser_swiftfusion.tools.models.parallel import install_runner_runtime_state
    install_runner_runtime_state(type(pipeline, (_Pipe,), {})(transformer))


def run_cases(name: str, cases, want: torch.Tensor, path: str, inputs: dict,
              topology: str = TOPOLOGY) -> list[dict]:
    """Every case ``(strategy, ulysses, ring)`` on this rank: route USP, build the wrapper,
    one forward; ``{"case", "mesh", "err", "calls", "fallbacks", "seconds"}`` per case
    (``err``: max |out - want| / max |want|), or ``"error"`` with the exception text."""
    from xfuser_swiftfusion.integrations.xfuser import restore_usp, use_strategy
    torch.set_num_threads(1)
    fam = FAMILIES[name]
    out = []
    logging.getLogger("xfuser").setLevel(logging.ERROR)   # xFuser logs every setup at DEBUG
    for strategy, u, r in cases:
        t0 = time.perf_counter()
        row = {"case": (strategy, u, r)}
        ctx = use_strategy(strategy, fam.heads, topology, ulysses_degree=u, ring_degree=r)
        try:
            model = fam.parallel(path)
            runner_runtime_state(fam.pipeline, getattr(model, "module", model))
            with torch.no_grad():
                kw = dict(inputs)
                if fam.prepare is not None:
                    kw = fam.prepare(model, kw) or kw
                got = fam.output(fam.call(model, kw), inputs)
                if fam.gather is not None:
                    got = fam.gather(got)
            stats = ctx.stats()
            row.update(mesh=stats["mesh"], calls=stats["calls"], fallbacks=dict(stats["fallbacks"]),
                       err=((got.double() - want.double()).abs().max()
                            / want.double().abs().max()).item() if got.shape == want.shape
                       else f"shape {tuple(got.shape)} != {tuple(want.shape)}")
        except Exception as exc:  # noqa: BLE001  (reported per case, the test names it)
            import traceback
            row["error"] = f"{type(exc).__name__}: {exc}"
            row["traceback"] = traceback.format_exc()
        finally:
            restore_usp()
        row["seconds"] = time.perf_counter() - t0
        out.append(row)
    return out


def cases(name: str) -> tuple:
    """The cases of ``name``: the U2xR2 ones only where its runner allows ``--ring_degree``."""
    ring = FAMILIES[name].ring
    return tuple(c for c in CASES if ring or c[1] is None)


def run_sparse_case(name: str, path: str, inputs: dict, backend: str,
                    topology: str = TOPOLOGY) -> dict:
    """One forward of ``name`` under ``tas`` with xFuser's attention backend set to the sparse
    ``backend``; its first USP call falls back (the backend then fails: no CPU kernel).
    ``{"fallbacks", "logged", "error"}``."""
    from xfuser.core.distributed import get_runtime_state
    from xfuser.core.distributed.attention_backend import AttentionBackendType
    from xfuser_swiftfusion.integrations.xfuser import restore_usp, use_strategy
    torch.set_num_threads(1)
    fam = FAMILIES[name]
    messages: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    handler = Catch(level=logging.WARNING)
    logging.getLogger("xfuser.swiftfusion").addHandler(handler)
    ctx = use_strategy("tas", fam.heads, topology)
    try:
        model = fam.parallel(path)
        runner_runtime_state(fam.pipeline, model)
        get_runtime_state().attention_backend = AttentionBackendType[backend]
        error = None
        try:
            with torch.no_grad():
                model(**inputs, return_dict=False)
        except Exception as exc:  # noqa: BLE001  (the sparse kernel is GPU-only)
            error = f"{type(exc).__name__}: {exc}"
        stats = ctx.stats()
    finally:
        restore_usp()
        logging.getLogger("xfuser.swiftfusion").removeHandler(handler)
    return {"fallbacks": dict(stats["fallbacks"]), "error": error,
            "logged": any(backend in m and "does not implement" in m for m in messages)}


def prepare(name: str, tmp: str) -> tuple[torch.Tensor, str, dict]:
    """In the parent: build the reference, save it to ``tmp``, compute the reference output."""
    fam = FAMILIES[name]
    ref, inputs = fam.build()
    ref.save_pretrained(tmp, safe_serialization=True)
    return fam.reference(ref, inputs), tmp, inputs


__all__ = ["FAMILIES", "Family", "CASES", "STRATEGIES", "HEADS", "TOPOLOGY", "cases",
           "run_cases", "run_sparse_case", "prepare", "runner_runtime_state"]
