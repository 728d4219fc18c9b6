"""FLUX.2 and Qwen-Image through xFuser 0.7.0's runner wrappers with any text length, exact.

xFuser's wrappers split the text over the SP ranks: ``xFuserFlux2Transformer2DWrapper``
``torch.chunk``s it unevenly when its length is not divisible by the SP degree (the ranks then
disagree on the sequence length), ``xFuserQwenImageTransformerWrapper`` zero-pads it (the pad
tokens are attended to). While a strategy is routed, ``runner.patch_flux2_wrapper`` /
``patch_qwen_wrapper`` replicate such text and pass it to USP as joint tokens in front.

Reference: the single-device diffusers forward (``Flux2Transformer2DModel`` /
``QwenImageTransformer2DModel``, same weights and inputs, fp32), independent of the code under
test. Bound: max |parallel - single| / max |single| <= 1e-5 (fp32 reassociation; observed
~3e-7), zero fallbacks, one strategy call per attention layer.
"""
from __future__ import annotations

import torch

import xfuser_swiftfusion  # noqa: F401  (CPU compatibility layer)
from xfuser_swiftfusion.integrations import xfuser as xp

xp.install()
# Import xFuser's pieces in the parent once: forked ranks inherit them.
import xfuser  # noqa: E402,F401
from xfuser.model_executor.models.transformers import transformer_flux2 as xf_flux2  # noqa: E402
from xfuser.model_executor.models.transformers import transformer_qwen as xf_qwen  # noqa: E402
from diffusers import Flux2Transformer2DModel, QwenImageTransformer2DModel  # noqa: E402

from xfuser_swiftfusion.emulation.launcher import run_emulated  # noqa: E402
from xfuser_swiftfusion.integrations.xfuser import state as xs  # noqa: E402

HEADS = 8
TOL = 1e-5
TEXTS = (8, 7, 2)              # divisible by the 4 SP ranks / not / fewer tokens than ranks
IMAGE = 16                     # image tokens (divisible by 4)
# (strategy, ulysses_degree, ring_degree): None = the strategy's own mesh on 2x2
ROUTES = (("tas", None, None), ("tas", 2, 2), ("torus", None, None), ("swiftfusion", None, None),
          ("usp", 4, 1), ("usp", 2, 2))
FLUX2_CFG = dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                 attention_head_dim=8, num_attention_heads=HEADS, joint_attention_dim=32,
                 timestep_guidance_channels=16, axes_dims_rope=(2, 2, 2, 2),
                 guidance_embeds=False)
QWEN_CFG = dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=8,
                num_attention_heads=HEADS, joint_attention_dim=32, axes_dims_rope=(2, 2, 4))
LAYERS = {"flux2": 2, "qwen": 2}   # attention calls per forward


def _flux2_inputs(image: int, text: int, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    i = torch.arange(image, dtype=torch.float32)
    t = torch.arange(text, dtype=torch.float32)
    zi, zt = torch.zeros_like(i), torch.zeros_like(t)
    return dict(hidden_states=torch.randn(1, image, 16, generator=g),
                encoder_hidden_states=torch.randn(1, text, 32, generator=g),
                timestep=torch.tensor([0.5]),
                img_ids=torch.stack([zi, i // 4, i % 4, zi], -1)[None],   # [1, S, 4] (t, h, w, l)
                txt_ids=torch.stack([zt, zt, zt, t], -1)[None])           # [1, T, 4]


def _qwen_inputs(image: int, text: int, seed: int = 1, mask=None) -> dict:
    g = torch.Generator().manual_seed(seed)
    rows = 4 if image % 4 == 0 else 3
    return dict(hidden_states=torch.randn(1, image, 16, generator=g),
                encoder_hidden_states=torch.randn(1, text, 32, generator=g),
                encoder_hidden_states_mask=mask, timestep=torch.tensor([0.5]),
                img_shapes=[(1, rows, image // rows)])


MODELS = {"flux2": (Flux2Transformer2DModel, lambda: xf_flux2.xFuserFlux2Transformer2DWrapper,
                    FLUX2_CFG, _flux2_inputs),
          "qwen": (QwenImageTransformer2DModel, lambda: xf_qwen.xFuserQwenImageTransformerWrapper,
                   QWEN_CFG, _qwen_inputs)}


def _models(kind: str):
    ref_cls, par_cls, cfg, _ = MODELS[kind]
    torch.manual_seed(0)
    ref = ref_cls(**cfg).eval()
    par = par_cls()(**cfg).eval()
    par.load_state_dict(ref.state_dict())
    return ref, par


@torch.no_grad()
def _error(ref, par, inputs: dict) -> float:
    want = ref(**inputs).sample.double()
    got = par(**inputs).sample.double()
    return (got - want).abs().max().item() / want.abs().max().item()


def _error_message(fn) -> str:
    try:
        fn()
    except xp.PluginError as exc:
        return str(exc)
    return "no error"


def _rank_text_lengths() -> dict:
    torch.set_num_threads(1)
    models = {kind: _models(kind) for kind in MODELS}
    res = {}
    # xFuser's own Qwen-Image path (nothing routed): zero-padded text keys
    xs.init_xfuser_parallel(4, 1, "usp")
    try:
        res["qwen_pristine_text7"] = _error(*models["qwen"], _qwen_inputs(IMAGE, 7))
    finally:
        xs.destroy_xfuser_parallel()
    for strategy, u, r in ROUTES:
        ctx = xp.use_strategy(strategy, HEADS, "2x2", ulysses_degree=u, ring_degree=r)
        route = f"{strategy}/{ctx.mesh.describe().split()[0]}"
        try:
            for kind, (_, _, _, inputs) in MODELS.items():
                for text in TEXTS:
                    ctx.reset_stats()
                    err = _error(*models[kind], inputs(IMAGE, text))
                    stats = ctx.stats()
                    res[(route, kind, text)] = (err, stats["calls"], stats["fallbacks"])
            if strategy == "swiftfusion":
                res["flux2_image15"] = _error_message(
                    lambda: _error(*models["flux2"], _flux2_inputs(15, 8)))
                res["qwen_image15"] = _error_message(
                    lambda: _error(*models["qwen"], _qwen_inputs(15, 8)))
                mask = torch.ones(1, 7, dtype=torch.bool)
                mask[0, 5:] = False
                res["qwen_padded_mask"] = _error_message(
                    lambda: _error(*models["qwen"], _qwen_inputs(IMAGE, 7, mask=mask)))
                res["qwen_full_mask"] = _error(
                    *models["qwen"], _qwen_inputs(IMAGE, 7, mask=torch.ones(1, 7, dtype=torch.bool)))
        finally:
            xp.restore_usp()
    return res


def test_flux2_and_qwen_any_text_length_every_strategy():
    results = run_emulated(_rank_text_lengths, "2x2", timeout_s=400)
    for rank, res in enumerate(results):
        # the bug being fixed: xFuser's own Qwen-Image path attends to zero-padded text keys
        assert res["qwen_pristine_text7"] > 1e-4, (rank, res["qwen_pristine_text7"])
        routes = {key[0] for key in res if isinstance(key, tuple)}
        assert len(routes) == len(ROUTES), routes          # usp U4xR1 and U2xR2 both ran
        for (route, kind, text), (err, calls, fallbacks) in (
                (k, v) for k, v in res.items() if isinstance(k, tuple)):
            assert err <= TOL, (rank, route, kind, text, err)
            assert calls == LAYERS[kind] and fallbacks == {}, (rank, route, kind, text, calls,
                                                                fallbacks)
        for kind in ("flux2", "qwen"):
            assert "15 image tokens are not divisible by the SP degree 4" in \
                res[f"{kind}_image15"], res[f"{kind}_image15"]
        assert "ignores masks" in res["qwen_padded_mask"], res["qwen_padded_mask"]
        assert res["qwen_full_mask"] <= TOL, res["qwen_full_mask"]
