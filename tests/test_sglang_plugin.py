"""The SGLang plugin loads through its entry point (``sglang.multimodal_gen.plugins``) in a fresh
worker process, in the order SGLang's worker bootstrap uses (``sglang_env._bootstrap``; the
session's SGLang child starts that way), and hooks ``USPAttention.forward`` only when a strategy
is set; configuration errors are loud."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from support import sglang_env

_reason = sglang_env.absent()
if _reason:
    pytest.skip(_reason, allow_module_level=True)

# what runtime/managers/worker_bootstrap.py does before importing the GPU worker
_WORKER = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from support.sglang_env import _bootstrap, install_torchvision_stub
install_torchvision_stub()
print(json.dumps(_bootstrap()))
"""


def _worker(tmp_path: Path, strategy: str | None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _WORKER, str(sglang_env.ROOT / "tests")],
                          env=sglang_env.worker_env(tmp_path, strategy), capture_output=True,
                          text=True, timeout=300)


def test_declared_entry_point_resolves():
    module, _, attr = sglang_env.declared_entry_point().partition(":")
    from xfuser_swiftfusion.integrations.sglang import plugin
    assert module == plugin.__name__ and getattr(plugin, attr) is plugin.register


def test_plugin_loads_in_a_fresh_worker(sglang_child):
    """The session's SGLang child starts as a fresh worker with $SWIFTFUSION_STRATEGY=torus."""
    assert sglang_child.bootstrap == {"installed": True, "strategy": "torus"}


@pytest.mark.slow
def test_plugin_without_strategy_changes_nothing(tmp_path):
    done = _worker(tmp_path, None)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"installed": False,
                                                                "strategy": None}


def test_unknown_strategy_is_an_error():
    from xfuser_swiftfusion.integrations.sglang import config
    with pytest.raises(ValueError, match="SWIFTFUSION_STRATEGY"):
        config.parse_strategy("ulyses")
    assert config.parse_strategy("usp") is None and config.parse_strategy(None) is None


def test_calls_our_strategies_do_not_take_are_named():
    """Each argument or layer property outside our strategies' contract names its reason; the
    plain call and the replicated prefix/suffix are taken."""
    import inspect
    from types import SimpleNamespace

    import torch

    from xfuser_swiftfusion.integrations.sglang import calls

    def forward(self, q, k, v, attn_mask=None, num_replicated_prefix=0, num_replicated_suffix=0,
                num_replicated_kv_prefix=0, skip_sequence_parallel_override=False,
                attn_mask_meta=None, qkv_pre_all_to_all=False, seq_lens=None, q_prefix=None,
                k_prefix=None, v_prefix=None):
        """The signature of SGLang 0.5.23's USPAttention.forward."""

    sig = inspect.signature(forward)
    layer = SimpleNamespace(skip_sequence_parallel=False, causal=False, dropout_p=0.0,
                            backend=SimpleNamespace(is_sparse=False, name="FA"))
    q = torch.zeros(1, 4, 2, 8)
    plain = dict(q=q, k=q, v=q)
    why = lambda lay=layer, **kw: calls.unsupported(calls.bind(sig, (lay,), {**plain, **kw}))  # noqa: E731
    assert why() is None
    assert why(num_replicated_prefix=2) is None and why(num_replicated_suffix=2) is None
    assert why(attn_mask=torch.ones(1, 4, dtype=torch.bool)) == "attention mask"
    assert why(attn_mask_meta={"pad_start": 3}) == "attention mask metadata (varlen / tail pad)"
    assert why(num_replicated_kv_prefix=3) == "replicated K/V prefix"
    assert why(seq_lens=[4]) == "packed variable-length sequences (seq_lens)"
    assert why(qkv_pre_all_to_all=True) == "q/k/v already exchanged (qkv_pre_all_to_all)"
    assert why(skip_sequence_parallel_override=True) == "skip_sequence_parallel_override"
    assert why(num_replicated_prefix=1, num_replicated_suffix=1) == \
        "replicated prefix and suffix in one call"
    assert why(k=torch.zeros(1, 6, 2, 8), v=torch.zeros(1, 6, 2, 8)) == \
        "q and k/v of different lengths (cross-attention)"
    for name, value, reason in (("causal", True, "causal attention"),
                                ("skip_sequence_parallel", True,
                                 "skip_sequence_parallel layer (replicated K/V)"),
                                ("dropout_p", 0.1, "attention dropout")):
        assert why(SimpleNamespace(**{**vars(layer), name: value})) == reason
    sparse = SimpleNamespace(**{**vars(layer), "backend": SimpleNamespace(is_sparse=True, name="VSA")})
    assert why(sparse) == "sparse attention backend VSA"


def _pre_exchange_rank():
    """What Qwen-Image's call of SGLang's caller-side exchange gets, without and with a strategy
    and after ``uninstall`` (an emulated rank; the exchange itself is CUDA-only, so a recorder
    stands in for it: "exchanged" when it ran)."""
    import torch.distributed as dist  # noqa: F401

    from sglang.multimodal_gen.runtime.layers import usp
    from support import sglang_ranks
    from xfuser_swiftfusion.integrations import sglang as sfs
    sglang_ranks.setup()
    real = usp._ipc_input_a2a_qkv_segmented
    ran = []

    def recorder(*args):
        ran.append(len(args))
        return "exchanged"

    def call():  # as qwen_image.py imports it: from the module, at the call
        from sglang.multimodal_gen.runtime.layers.usp import _ipc_input_a2a_qkv_segmented
        return _ipc_input_a2a_qkv_segmented(*range(7))

    usp._ipc_input_a2a_qkv_segmented = recorder
    try:
        seen = [call()]
        sfs.install("torus")
        try:
            seen.append(call())
        finally:
            sfs.uninstall()
        seen.append(call())
    finally:
        usp._ipc_input_a2a_qkv_segmented = real
        sglang_ranks.teardown()
    return seen, ran


def pre_exchange():
    from xfuser_swiftfusion.emulation.launcher import run_emulated
    return run_emulated(_pre_exchange_rank, "1x2", timeout_s=120)


def test_pre_exchange_declined_while_a_strategy_runs(sglang_child):
    """With a strategy on, SGLang's caller-side Ulysses exchange (Qwen-Image's joint q/k/v on
    CUDA) answers "unavailable", so the call reaches ``USPAttention`` sequence-sharded and runs
    on the strategy; without one (before install, after uninstall) SGLang's exchange runs."""
    (per_rank,) = sglang_child.run([(Path(__file__).stem, "pre_exchange", ())])
    for seen, ran in per_rank:
        assert seen == ["exchanged", None, "exchanged"] and ran == [7, 7], (seen, ran)
