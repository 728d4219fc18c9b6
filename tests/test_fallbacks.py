"""Which xFuser USP calls go back to xFuser's USP: the ignored attention_kwargs keys are exactly
the sparse-backend settings (Wan's runner passes them all), an unknown key still falls back,
and a sparse backend falls back as a whole."""
import pytest

from xfuser_swiftfusion.integrations.xfuser.fallbacks import (IGNORED_ATTENTION_KWARGS,
                                                               attention_kwargs_reason,
                                                               sparse_backend_reason)


class _Config:
    """The xFuserArgs fields Wan's runner reads, at xFuser 0.7.0's defaults or set."""

    def __getattr__(self, name):
        return 0.5 if name.startswith(("vsa_", "spargeattn_")) else True


def test_wan_runner_attention_kwargs_run_our_strategies():
    from xfuser.model_executor.models.runner_models import wan
    kwargs = wan._build_attention_kwargs(_Config())
    assert len(kwargs) == 14 and all(v is not None for k, v in kwargs.items() if k != "thw")
    assert attention_kwargs_reason(kwargs) is None
    assert set(kwargs) <= set(IGNORED_ATTENTION_KWARGS)


@pytest.mark.parametrize("key", ["attn_mask", "valid_kv_len", "ulysses_extra_inputs",
                                 "a_key_nobody_knows_yet"])
def test_other_keys_fall_back(key):
    reason = attention_kwargs_reason({"thw": (2, 4, 4), "vsa_top_k": 3, key: 1})
    if key == "attn_mask":  # not a bool tensor: not a key mask the strategies apply
        assert reason == "attention_kwargs ['attn_mask'] (not a bool tensor (int))"
    else:
        assert reason == f"attention_kwargs ['{key}']"
    assert attention_kwargs_reason({key: None}) is None   # unset keys are not used


@pytest.mark.parametrize("name,sparse", [("SDPA_FLASH", False), ("FLASH_3", False),
                                         ("AITER_SPARGE", True), ("AITER_VSA", True),
                                         ("TRITON_VSA_H3", True), ("AITER_SPARSE_SAGE", True),
                                         ("SAGE", False), (None, False)])
def test_sparse_backends_fall_back(name, sparse):
    assert (sparse_backend_reason(name) is not None) is sparse


# --- GQA (Lumina2) and key-padding masks (Krea-2) run on the strategies, not xFuser's USP -------

def test_krea2_mask_kwargs_are_honoured_not_ignored():
    import torch
    from xfuser.model_executor.layers.attention_mask import make_attn_mask_with_meta

    from xfuser_swiftfusion.integrations.xfuser.fallbacks import KEY_MASK_ATTENTION_KWARGS

    q = torch.randn(2, 4, 6, 8)
    meta = make_attn_mask_with_meta(torch.rand(2, 24) > 0.3)
    kwargs = {"attn_mask": meta.attn_mask, "indices_k": meta.indices_k,
              "cu_seqlens_k": meta.cu_seqlens_k, "max_seqlen_k": meta.max_seqlen_k}
    assert attention_kwargs_reason(kwargs, q, 4) is None
    assert not set(KEY_MASK_ATTENTION_KWARGS) & set(IGNORED_ATTENTION_KWARGS)
    # a mask the strategies cannot honour still falls back
    assert "shape" in attention_kwargs_reason(kwargs, q, 2)             # not the sharded length
    assert "joint" in attention_kwargs_reason(kwargs, q, 4, joint=True)
    assert "bool" in attention_kwargs_reason(dict(kwargs, attn_mask=meta.attn_mask.float()), q, 4)
    assert "check" in attention_kwargs_reason(kwargs)                    # nothing to check against
    # its varlen metadata alone is a mask we do not have: falls back
    assert attention_kwargs_reason({"indices_k": meta.indices_k}, q, 4) == "attention_kwargs ['indices_k']"


def _rank_routed_gqa_and_mask(strategies):
    import torch
    import torch.distributed as dist

    import xfuser_swiftfusion  # noqa: F401  (CPU compatibility layer)
    from xfuser_swiftfusion.integrations import xfuser as xp
    from xfuser.model_executor.layers import usp as xf_usp
    from xfuser.model_executor.layers.attention_mask import make_attn_mask_with_meta
    from support.reference import max_abs_err, rank_rows

    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    H, S, D = 24, 6, 8
    L = S * world
    g = torch.Generator().manual_seed(11)
    q = torch.randn(2, H, L, D, generator=g)
    k8, v8 = (torch.randn(2, 8, L, D, generator=g) for _ in range(2))    # Lumina2: 8 K/V heads
    k, v = (torch.randn(2, H, L, D, generator=g) for _ in range(2))
    valid = torch.ones(2, L, dtype=torch.bool)   # Krea-2: [text | text pad | image | SP pad]
    valid[0, 3:6] = valid[1, 5:6] = False
    valid[:, L - 2:] = False
    valid[1, :S] = False                         # batch 1: rank 0's keys all masked
    meta = make_attn_mask_with_meta(valid)
    kw = {"attn_mask": meta.attn_mask, "indices_k": meta.indices_k,
          "cu_seqlens_k": meta.cu_seqlens_k, "max_seqlen_k": meta.max_seqlen_k}
    mine = slice(rank * S, (rank + 1) * S)
    res = {}
    for name in strategies:
        ctx = xp.use_strategy(name, H, "2x2")
        try:
            ctx.reset_stats()
            out = xf_usp.USP(q[:, :, mine], k8[:, :, mine], v8[:, :, mine], kv_head_repeat=3)
            res[(name, "gqa")] = max_abs_err(out, rank_rows(q, k8, v8, rank, world))
            out = xf_usp.USP(q[:, :, mine], k[:, :, mine], v[:, :, mine], attention_kwargs=kw)
            res[(name, "mask")] = max_abs_err(out, rank_rows(q, k, v, rank, world, key_mask=valid))
            res[(name, "unmasked")] = max_abs_err(out, rank_rows(q, k, v, rank, world))
            st = ctx.stats()
            res[(name, "stats")] = (st["calls"], st["fallbacks"], ctx.strategy)
        finally:
            xp.restore_usp()
    return res


def test_routed_usp_runs_gqa_and_key_masks():
    from xfuser_swiftfusion.emulation.launcher import run_emulated
    from xfuser_swiftfusion.integrations.xfuser import compat
    from xfuser_swiftfusion.strategies.registry import specs

    compat.apply()
    import xfuser.model_executor.layers.usp  # noqa: F401  (ranks inherit the patched xFuser)
    specs()
    strategies = ("tas", "torus", "swiftfusion", "auto")
    for res in run_emulated(_rank_routed_gqa_and_mask, "2x2", strategies, timeout_s=300):
        for name in strategies:
            calls, fallbacks, ran = res[(name, "stats")]
            assert (calls, fallbacks) == (2, {}), (name, ran, calls, fallbacks)
            assert res[(name, "gqa")] <= 1e-5 and res[(name, "mask")] <= 1e-5, (name, res)
            assert res[(name, "unmasked")] > 1e-2  # the mask changed the result


# --- FP8 communication (--use_fp8_comms): runs on a context built with fp8_comms --------------

def _rank_routed_fp8(strategies):
    import torch
    import torch.distributed as dist

    import xfuser_swiftfusion  # noqa: F401  (CPU compatibility layer)
    from xfuser_swiftfusion.integrations import xfuser as xp
    from xfuser_swiftfusion.integrations.xfuser import routing
    from xfuser.core.distributed import get_runtime_state
    from xfuser.core.distributed.fp8_comms import Fp8CommsState
    from xfuser.model_executor.layers import usp as xf_usp
    from support.reference import rank_rows

    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    H, S, D = 4, 6, 8
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, H, S * world, D, generator=g) for _ in range(3))
    ref = rank_rows(q, k, v, rank, world)
    mine = lambda x: x[:, :, rank * S:(rank + 1) * S].to(torch.bfloat16)  # noqa: E731
    layer = torch.nn.Identity()  # the attention module xFuser's USP gets as attn_layer
    res = {}
    for name in strategies:
        for flag, fp8 in (("plain", False), ("flag", False), ("flag", True)):
            xp.install()  # routing.use_strategy: the package's wrapper does not pass fp8_comms yet
            ctx = routing.use_strategy(name, H, "2x2", fp8_comms=fp8)  # builds xFuser's runtime state
            xstate = get_runtime_state()
            xstate.fp8_comms = Fp8CommsState() if flag == "flag" else None  # --use_fp8_comms
            try:
                ctx.reset_stats()
                out = xf_usp.USP(mine(q), mine(k), mine(v), attn_layer=layer)
                st = ctx.stats()
                res[name, flag, fp8] = (st["calls"], st["fallbacks"], st["inter_node_bytes"],
                                        st["intra_node_bytes"],
                                        ((out.double() - ref).abs().max() / ref.abs().max()).item())
            finally:
                xstate.fp8_comms = None
                xp.restore_usp()
    return res


def test_use_fp8_comms_runs_on_strategies_built_with_fp8_comms():
    from xfuser_swiftfusion.emulation.launcher import run_emulated
    from xfuser_swiftfusion.integrations.xfuser import compat
    from xfuser_swiftfusion.strategies.registry import specs

    compat.apply()
    import xfuser.model_executor.layers.usp  # noqa: F401  (ranks inherit the patched xFuser)
    specs()
    strategies = ("tas", "swiftfusion")
    T, U = 2, 2  # 4 heads on 2x2: Ulysses 4 over both machines
    for res in run_emulated(_rank_routed_fp8, "2x2", strategies, timeout_s=300):
        for name in strategies:
            plain, without, with_ = (res[name, "plain", False], res[name, "flag", False],
                                     res[name, "flag", True])
            assert plain[:2] == (1, {}) and with_[:2] == (1, {}), (name, plain, with_)
            assert without[1] == {"FP8 communication (--use_fp8_comms) on a context built "
                                  "without fp8_comms": 1}, (name, without)
            assert with_[2] == plain[2] // 2 + 4 * 4 * U * (T - 1), (name, plain, with_)
            assert with_[3] == plain[3]
            assert plain[4] < with_[4] <= 0.25, (name, plain, with_)
