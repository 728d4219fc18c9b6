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
    assert reason == f"attention_kwargs ['{key}']"
    assert attention_kwargs_reason({key: None}) is None   # unset keys are not used


@pytest.mark.parametrize("name,sparse", [("SDPA_FLASH", False), ("FLASH_3", False),
                                         ("AITER_SPARGE", True), ("AITER_VSA", True),
                                         ("TRITON_VSA_H3", True), ("AITER_SPARSE_SAGE", True),
                                         ("SAGE", False), (None, False)])
def test_sparse_backends_fall_back(name, sparse):
    assert (sparse_backend_reason(name) is not None) is sparse
