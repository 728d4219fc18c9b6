"""Sequence parallelism for diffusers' Flux, CogVideoX and Wan pipelines, the xFuser way.

``parallelize_flux(pipe)`` / ``parallelize_cogvideox(pipe)`` wrap ``pipe.transformer`` so that
each SP rank (xFuser's ``get_sequence_parallel_rank``) holds a contiguous 1/W of the image
tokens, every attention goes through xFuser's module-level ``USP()`` (the function our
strategies replace), and the output is all-gathered over xFuser's SP group. Both follow
xFuser 0.7.0's wrappers (``xFuserFlux1Transformer2DWrapper``, ``examples/
cogvideox_usp_example.py``) with their bugs fixed:

- text tokens are sharded with the image when ``T % W == 0`` (xFuser's
  ``split_text_embed_in_sp``) and otherwise replicated and passed to USP as
  ``joint_query/key/value`` with ``joint_strategy="front"`` (xFuser's runner concatenates the
  replicated text instead, counting every text key W times; the CogVideoX example all-gathers
  replicated text, giving W copies);
- image tokens must split evenly (no zero padding, which would add keys): a clear error names
  the constraint otherwise.

``parallelize_wan(pipe)`` puts xFuser's own ``xFuserWanTransformer3DWrapper`` in place of
``pipe.transformer`` (same weights), set up as xFuser's Wan runner loads it (its
``attention_kwargs`` from ``_build_attention_kwargs``, xFuser's ``DiTRuntimeState`` built from
the pipeline; ``integrations.xfuser.install`` makes its processors look ``USP`` up per call);
the wrapper shards the video tokens itself. Its zero padding of a token count
that does not split evenly would add keys, so that count must split evenly (``check_shapes``).

Layouts: Flux packed latents ``[B, L, C]`` (L = image tokens, row-major), ids ``[L, 3]``;
CogVideoX latents ``[B, F, C, H, W]``, sharded by latent rows (``H / W_sp`` rows per rank, a
multiple of the patch size), tokens per frame row-major; Wan latents ``[B, C, F, H, W]``,
tokens ``(F, H/2, W/2)`` row-major, contiguous ``1/W_sp`` per rank.
"""
from __future__ import annotations

import contextlib
import functools
import json
from pathlib import Path
from typing import Callable, Iterator

import torch
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor, _get_qkv_projections

from ...log import get_logger

logger = get_logger(__name__)


class ShapeError(ValueError):
    """A size the sequence-parallel split cannot take; the message names the constraint."""


def _sp() -> tuple[int, int, object]:
    """(SP world size, SP rank, xFuser SP group coordinator)."""
    from xfuser.core.distributed import (get_sequence_parallel_rank,
                                         get_sequence_parallel_world_size, get_sp_group)
    return get_sequence_parallel_world_size(), get_sequence_parallel_rank(), get_sp_group()


def _usp(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, text_tokens: int, attn) -> torch.Tensor:
    """xFuser's ``USP`` (looked up at call time, so a rebound USP is used) on ``[B, H, S, D]``.

    ``text_tokens > 0``: the first ``text_tokens`` rows are replicated text, passed as joint
    tensors; the output keeps them in front: ``[B, H, text_tokens + S_img, D]``.
    """
    from xfuser.model_executor.layers import usp as usp_module
    if not text_tokens:
        return usp_module.USP(q, k, v, dropout_p=0.0, is_causal=False,
                              combine_qkv_a2a=True, attn_layer=attn)
    t = text_tokens
    return usp_module.USP(q[:, :, t:], k[:, :, t:], v[:, :, t:], dropout_p=0.0, is_causal=False,
                          joint_query=q[:, :, :t], joint_key=k[:, :, :t], joint_value=v[:, :, :t],
                          joint_strategy="front", combine_qkv_a2a=True, attn_layer=attn)


class FluxUSPAttnProcessor(FluxAttnProcessor):
    """diffusers' Flux attention with the attention itself done by xFuser's ``USP``.

    ``replicated_text``: number of leading text tokens that every rank holds in full (0 when
    the text is sharded with the image); set by ``parallelize_flux`` before each forward.
    """

    def __init__(self) -> None:
        super().__init__()
        self.replicated_text = 0

    def __call__(self, attn, hidden_states: torch.Tensor,
                 encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None,
                 image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None):
        if attention_mask is not None:
            raise NotImplementedError("FluxUSPAttnProcessor: attention masks are not supported "
                                      "under sequence parallelism")
        q, k, v, eq, ek, ev = _get_qkv_projections(attn, hidden_states, encoder_hidden_states)
        q, k, v = (t.unflatten(-1, (attn.heads, -1)) for t in (q, k, v))  # [B, S, H, D]
        q, k = attn.norm_q(q), attn.norm_k(k)
        if attn.added_kv_proj_dim is not None:  # double block: text arrives separately
            eq, ek, ev = (t.unflatten(-1, (attn.heads, -1)) for t in (eq, ek, ev))
            eq, ek = attn.norm_added_q(eq), attn.norm_added_k(ek)
            q, k, v = (torch.cat([e, x], dim=1) for e, x in ((eq, q), (ek, k), (ev, v)))
        if image_rotary_emb is not None:
            q = apply_rotary_emb(q, image_rotary_emb, sequence_dim=1)
            k = apply_rotary_emb(k, image_rotary_emb, sequence_dim=1)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))                 # [B, H, S, D]
        out = _usp(q, k, v, self.replicated_text, attn)                   # [B, H, S, D]
        out = out.transpose(1, 2).flatten(2, 3).to(q.dtype)               # [B, S, H*D]
        if encoder_hidden_states is None:
            return out
        txt, img = out.split_with_sizes(
            [encoder_hidden_states.shape[1], out.shape[1] - encoder_hidden_states.shape[1]], dim=1)
        img = attn.to_out[1](attn.to_out[0](img))
        return img, attn.to_add_out(txt)


def _check_split(what: str, n: int, world: int, fix: str) -> None:
    if n % world:
        raise ValueError(f"{what} ({n}) is not divisible by the sequence-parallel degree "
                         f"{world}; {fix}")


def parallelize_flux(pipe) -> None:
    """Shard a ``FluxPipeline``'s transformer over xFuser's SP group (in place, idempotent)."""
    transformer = pipe.transformer
    if getattr(transformer, "_swiftfusion_sp", False):
        return
    processors = []
    for block in (*transformer.transformer_blocks, *transformer.single_transformer_blocks):
        block.attn.processor = FluxUSPAttnProcessor()
        processors.append(block.attn.processor)
    original_forward = transformer.forward

    @functools.wraps(original_forward)
    def forward(hidden_states, encoder_hidden_states=None, *args, img_ids=None, txt_ids=None,
                return_dict: bool = True, **kwargs):
        world, rank, group = _sp()
        L, T = hidden_states.shape[1], encoder_hidden_states.shape[1]
        _check_split("Flux image tokens (height/16 * width/16 for FLUX.1)", L, world,
                     "choose height and width so that their token count splits evenly")
        split_text = T % world == 0
        for p in processors:
            p.replicated_text = 0 if split_text else T
        hidden_states = hidden_states.chunk(world, dim=1)[rank]           # [B, L/W, C]
        img_ids = img_ids.chunk(world, dim=-2)[rank]                      # [L/W, 3]
        if split_text:
            encoder_hidden_states = encoder_hidden_states.chunk(world, dim=1)[rank]
            txt_ids = txt_ids.chunk(world, dim=-2)[rank]
        out = original_forward(hidden_states, encoder_hidden_states, *args, img_ids=img_ids,
                               txt_ids=txt_ids, return_dict=False, **kwargs)
        sample = group.all_gather(out[0].contiguous(), dim=-2)            # [B, L, C]
        if return_dict:
            from diffusers.models.modeling_outputs import Transformer2DModelOutput
            return Transformer2DModelOutput(sample=sample)
        return (sample,)

    transformer.forward = forward
    transformer._swiftfusion_sp = True


def parallelize_cogvideox(pipe) -> None:
    """Shard a ``CogVideoXPipeline``'s transformer over xFuser's SP group (in place, idempotent).

    Attention runs in xFuser's ``xFuserCogVideoXAttnProcessor2_0`` (text concatenated when
    sharded, joint ``"front"`` when replicated: it reads ``split_text_embed_in_sp``).
    """
    from xfuser.core.distributed import get_runtime_state
    from xfuser.model_executor.layers.attention_processor import xFuserCogVideoXAttnProcessor2_0

    transformer = pipe.transformer
    if getattr(transformer, "_swiftfusion_sp", False):
        return
    p = transformer.config.patch_size
    if transformer.config.patch_size_t is not None:
        raise NotImplementedError("CogVideoX 1.5 (patch_size_t) is not supported by "
                                  "parallelize_cogvideox; use a CogVideoX 1.0 checkpoint")
    original_forward = transformer.forward
    original_patch_embed = transformer.patch_embed.forward
    split = {"text": True}

    @functools.wraps(original_forward)
    def forward(hidden_states, encoder_hidden_states=None, timestep=None, timestep_cond=None,
                ofs=None, image_rotary_emb=None, return_dict: bool = True, **kwargs):
        world, rank, group = _sp()
        frames, height = hidden_states.shape[1], hidden_states.shape[-2]
        _check_split(f"CogVideoX latent rows / patch size ({height} / {p})", height // p, world,
                     f"choose a height whose latent rows are a multiple of {p * world}")
        split["text"] = encoder_hidden_states.shape[1] % world == 0
        get_runtime_state().split_text_embed_in_sp = split["text"]
        for block in transformer.transformer_blocks:
            if not isinstance(block.attn1.processor, xFuserCogVideoXAttnProcessor2_0):
                block.attn1.processor = xFuserCogVideoXAttnProcessor2_0()
        hidden_states = hidden_states.chunk(world, dim=-2)[rank]          # [B, F, C, H/W, Wd]
        if split["text"]:
            encoder_hidden_states = encoder_hidden_states.chunk(world, dim=-2)[rank]
        if image_rotary_emb is not None:
            def shard(freqs: torch.Tensor) -> torch.Tensor:
                d = freqs.shape[-1]
                freqs = freqs.reshape(frames, -1, d).chunk(world, dim=-2)[rank]  # [F, hw/W, d]
                return freqs.reshape(-1, d)                                      # [F*hw/W, d]
            image_rotary_emb = tuple(shard(f) for f in image_rotary_emb)
        out = original_forward(hidden_states, encoder_hidden_states, timestep=timestep,
                               timestep_cond=timestep_cond, ofs=ofs,
                               image_rotary_emb=image_rotary_emb, return_dict=False, **kwargs)
        sample = group.all_gather(out[0].contiguous(), dim=-2)            # [B, F, C, H, Wd]
        if return_dict:
            from diffusers.models.modeling_outputs import Transformer2DModelOutput
            return Transformer2DModelOutput(sample=sample)
        return (sample,)

    def patch_embed(text_embeds: torch.Tensor, image_embeds: torch.Tensor) -> torch.Tensor:
        world, rank, group = _sp()
        image_embeds = group.all_gather(image_embeds.contiguous(), dim=-2)   # [B, F, C, H, Wd]
        if split["text"]:
            text_embeds = group.all_gather(text_embeds.contiguous(), dim=-2)  # [B, T, Dt]
        B, T = image_embeds.shape[0], text_embeds.shape[1]
        out = original_patch_embed(text_embeds, image_embeds)               # [B, T + F*hw, D]
        text, image = out[:, :T], out[:, T:]
        image = image.reshape(B, image_embeds.shape[1], -1, out.shape[-1])  # [B, F, hw, D]
        image = image.chunk(world, dim=-2)[rank].reshape(B, -1, out.shape[-1])  # [B, F*hw/W, D]
        if split["text"]:
            text = text.chunk(world, dim=-2)[rank]                          # [B, T/W, D]
        return torch.cat([text, image], dim=1)

    transformer.forward = forward
    transformer.patch_embed.forward = patch_embed
    transformer._swiftfusion_sp = True


def install_runner_runtime_state(pipe) -> None:
    """xFuser's runtime state as its runner builds it for ``pipe``
    (``initialize_runtime_state(pipe, engine_config)``: a ``DiTRuntimeState``), on the
    xFuser groups that exist now; kept while they do (rebuilt after a new ``use_strategy``)."""
    from xfuser.config import xFuserArgs
    from xfuser.core.distributed import (get_ring_parallel_world_size,
                                         get_ulysses_parallel_world_size)
    from xfuser.core.distributed import runtime_state as rs
    if isinstance(rs._RUNTIME, rs.DiTRuntimeState):
        return
    engine_config, _ = xFuserArgs(model="swiftfusion", ulysses_degree=get_ulysses_parallel_world_size(),
                                  ring_degree=get_ring_parallel_world_size()).create_config()
    rs._RUNTIME = rs.DiTRuntimeState(pipe, engine_config)


def parallelize_wan(pipe) -> None:
    """Replace a ``WanPipeline``'s transformer with xFuser's ``xFuserWanTransformer3DWrapper``
    (same config and weights; in place, idempotent). Every forward runs on xFuser's runtime
    state for the pipeline (``install_runner_runtime_state``)."""
    from xfuser.model_executor.models.runner_models.wan import _build_attention_kwargs
    from xfuser.model_executor.models.transformers.transformer_wan import (
        xFuserWanTransformer3DWrapper)
    from xfuser.config import xFuserArgs

    transformer = pipe.transformer
    if getattr(transformer, "_swiftfusion_sp", False):
        return
    if type(transformer).__name__ != "WanTransformer3DModel":
        raise NotImplementedError(f"parallelize_wan: {type(transformer).__name__} is not "
                                  "supported; expected WanTransformer3DModel (Wan 2.1 / 2.2)")
    # the runner: load_transformer(xFuserWanTransformer3DWrapper, init_kwargs=
    # {"attention_kwargs": _build_attention_kwargs(config)}), xFuser's defaults here
    config = {k: v for k, v in transformer.config.items() if not k.startswith("_")}
    kwargs = {"attention_kwargs": _build_attention_kwargs(xFuserArgs(model="swiftfusion"))}
    wrapper = xFuserWanTransformer3DWrapper(**config, **kwargs)
    # the pipeline's own tensors (dtype per module, e.g. diffusers' fp32-kept norms), no copy
    wrapper.load_state_dict(transformer.state_dict(), strict=True, assign=True)
    wrapper.to(transformer.device).eval()           # the non-persistent buffers
    original_forward = wrapper.forward

    @functools.wraps(original_forward)
    def forward(hidden_states, *args, **kw):
        world, _, _ = _sp()
        _, _, frames, height, width = hidden_states.shape
        p_t, p_h, p_w = wrapper.config.patch_size
        tokens = (frames // p_t) * (height // p_h) * (width // p_w)
        _check_split(f"Wan video tokens ({frames // p_t} x {height // p_h} x {width // p_w} "
                     "latent patches)", tokens, world,
                     "choose a size and frame count whose latent patch count splits evenly "
                     "(xFuser's Wan wrapper pads with tokens that would become attention keys)")
        install_runner_runtime_state(pipe)
        return original_forward(hidden_states, *args, **kw)

    wrapper.forward = forward
    wrapper._swiftfusion_sp = True
    pipe.transformer = wrapper


# --------------------------------------------------------------------------------------------
# Loading, running and binding a strategy (shared by the examples and ``swiftfusion compare``)
# --------------------------------------------------------------------------------------------

KINDS = {"FluxPipeline": "flux", "CogVideoXPipeline": "cogvideox", "WanPipeline": "wan"}
PARALLELIZE = {"flux": parallelize_flux, "cogvideox": parallelize_cogvideox,
               "wan": parallelize_wan}
TINY = tuple(f"tiny-{kind}" for kind in PARALLELIZE)


def resolve_model(model: str, kind: str | None = None) -> tuple[str, str]:
    """``(kind, checkpoint dir)`` for ``tiny-flux`` / ``tiny-cogvideox`` / ``tiny-wan`` /
    ``tiny`` (with ``kind``) or a local diffusers checkpoint directory (kind read from
    model_index.json)."""
    from .tiny import tiny_checkpoint
    name = model.strip()
    if name in TINY:
        want = name.removeprefix("tiny-")
        if kind is not None and kind != want:
            raise ValueError(f"--model {name} is a {want} model, this entry point runs {kind}")
        return want, tiny_checkpoint(want)
    if name == "tiny":
        if kind is None:
            raise ValueError(f"--model tiny is ambiguous here; use {', '.join(TINY)}")
        return kind, tiny_checkpoint(kind)
    index = Path(name) / "model_index.json"
    if not index.is_file():
        raise ValueError(f"--model {name!r}: not a local diffusers checkpoint (no {index}); "
                         "pass a directory holding a FLUX.1 / CogVideoX / Wan checkpoint, or "
                         f"{' / '.join(TINY)} (the model hub is not used)")
    cls = json.loads(index.read_text()).get("_class_name", "")
    if cls not in KINDS:
        raise ValueError(f"--model {name}: pipeline {cls!r} is not supported; expected one of "
                         f"{', '.join(KINDS)}")
    if kind is not None and KINDS[cls] != kind:
        raise ValueError(f"--model {name} is a {KINDS[cls]} checkpoint, this entry point runs {kind}")
    return KINDS[cls], name


def load_pipeline(path: str, kind: str, dtype: torch.dtype, device: torch.device):
    """``FluxPipeline`` / ``CogVideoXPipeline`` / ``WanPipeline.from_pretrained(path)`` (local
    files only)."""
    import diffusers
    import transformers
    from diffusers import CogVideoXPipeline, FluxPipeline, WanPipeline
    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
    cls = {"flux": FluxPipeline, "cogvideox": CogVideoXPipeline, "wan": WanPipeline}[kind]
    pipe = cls.from_pretrained(path, dtype=dtype, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(device)


def generate_latents(pipe, kind: str, *, prompt: str, height: int, width: int, num_frames: int,
                     steps: int, seed: int, guidance_scale: float, max_sequence_length: int,
                     on_step: Callable[[int], None] | None = None, output_type: str = "latent"):
    """One denoising run. ``output_type="latent"``: Flux ``[B, L, C]`` packed latents,
    CogVideoX ``[B, F, C, H, W]``, Wan ``[B, C, F, H, W]``; otherwise the pipeline's decoded
    images / frames.
    ``on_step(i)`` is called after every step (after its transformer call)."""
    device = pipe._execution_device
    gen = torch.Generator(device="cpu").manual_seed(seed)
    callback = None
    if on_step is not None:
        def callback(_pipe, i, _t, kwargs):
            on_step(i)
            return kwargs
    common = dict(prompt=prompt, height=height, width=width, num_inference_steps=steps,
                  generator=gen, output_type=output_type, max_sequence_length=max_sequence_length,
                  guidance_scale=guidance_scale, callback_on_step_end=callback)
    out = pipe(**common).images if kind == "flux" else pipe(num_frames=num_frames, **common).frames
    return out.to(device) if isinstance(out, torch.Tensor) else out


def check_shapes(kind: str, path: str, height: int, width: int, world: int,
                 num_frames: int = 1) -> None:
    """The image sequence must split evenly over ``world`` ranks (raises
    ``ShapeError`` naming the constraint). Heads need no check: the Ulysses degree
    is ``gcd(world, heads)`` and Ring takes the rest. ``num_frames``: Wan's video length."""
    import json
    from pathlib import Path
    tcfg = json.loads((Path(path) / "transformer" / "config.json").read_text())
    vcfg = json.loads((Path(path) / "vae" / "config.json").read_text())
    if kind == "wan":
        return _check_wan_shapes(tcfg, vcfg, height, width, world, num_frames)
    vae = 2 ** (len(vcfg["block_out_channels"]) - 1)
    if kind == "flux":
        pack = 2 * vae
        if height % pack or width % pack:
            raise ShapeError(f"--height/--width must be multiples of {pack} for this "
                                       "Flux checkpoint")
        tokens = (height // pack) * (width // pack)
        if tokens % world:
            raise ShapeError(
                f"{height}x{width} gives {tokens} image tokens, not divisible by the "
                f"{world} ranks; choose a size whose (height/{pack})*(width/{pack}) is a "
                f"multiple of {world}")
    else:
        rows_per = vae * tcfg["patch_size"] * world
        if height % rows_per:
            raise ShapeError(
                f"--height {height}: CogVideoX shards latent rows in whole patches, so with "
                f"{world} ranks the height must be a multiple of {rows_per}")
        if width % (vae * tcfg["patch_size"]):
            raise ShapeError(f"--width must be a multiple of {vae * tcfg['patch_size']}")


def _check_wan_shapes(tcfg: dict, vcfg: dict, height: int, width: int, world: int,
                      num_frames: int) -> None:
    """Wan: the latent patch count ``(F' / p_t) (H / 8 p_h) (W / 8 p_w)`` must split evenly."""
    spatial = 2 ** sum(1 for _ in vcfg["temperal_downsample"])   # one 2x per down block
    temporal = 2 ** sum(bool(t) for t in vcfg["temperal_downsample"])
    p_t, p_h, p_w = tcfg["patch_size"]
    if height % (spatial * p_h) or width % (spatial * p_w):
        raise ShapeError(f"--height/--width must be multiples of {spatial * p_h} for this Wan "
                         "checkpoint")
    if (num_frames - 1) % temporal:
        raise ShapeError(f"--num_frames must be 1 + a multiple of {temporal} for this Wan "
                         "checkpoint")
    frames = ((num_frames - 1) // temporal + 1) // p_t
    tokens = frames * (height // (spatial * p_h)) * (width // (spatial * p_w))
    if tokens % world:
        raise ShapeError(
            f"{num_frames} frames of {height}x{width} give {tokens} video tokens, not divisible "
            f"by the {world} ranks (xFuser's Wan wrapper pads with tokens that would become "
            "attention keys); choose a size or frame count whose token count is a multiple of "
            f"{world}")


@contextlib.contextmanager
def strategy_session(strategy: str, num_heads: int, topology: str | None = None,
                     ulysses_degree: int | None = None, ring_degree: int | None = None,
                     timeout_s: float | None = None) -> Iterator[object]:
    """Bring up xFuser's parallel state with ``strategy`` routed into xFuser's ``USP`` and
    yield its ``SequenceParallelContext``; tear both down on exit."""
    from ...integrations.xfuser import restore_usp, use_strategy
    ctx = use_strategy(strategy, num_heads, topology=topology, ulysses_degree=ulysses_degree,
                       ring_degree=ring_degree, timeout_s=timeout_s)
    try:
        yield ctx
    finally:
        restore_usp()  # closes ctx and tears down the xFuser state use_strategy built


__all__ = ["parallelize_flux", "parallelize_cogvideox", "parallelize_wan",
           "install_runner_runtime_state", "FluxUSPAttnProcessor", "resolve_model",
           "load_pipeline", "generate_latents", "strategy_session", "check_shapes", "ShapeError",
           "PARALLELIZE"]
