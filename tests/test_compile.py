"""``torch.compile`` around sequence-parallel attention (xFuser's ``--use_torch_compile``).

``SequenceParallelContext.attention`` and the routed ``USP`` are excluded from compilation: a
compiled model breaks its graph exactly once per attention call, never recompiles on a repeated
call, and returns what the eager model returns. The reference is the same model in fp64 over
the whole sequence with ``support.reference`` attention (nothing from the code under test).

Backend: inductor (CPU, gcc), the backend xFuser's ``--use_torch_compile`` uses. Every strategy
compiles the same graphs (same model, shapes and dtype), so after the first strategy inductor's
FX graph cache serves the rest.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch._inductor.config
import torch.nn as nn

import xfuser_swiftfusion as sf
from xfuser_swiftfusion.integrations.xfuser import compat as xfuser_compat
from support.reference import attention as reference_attention, max_abs_err

# Apply + import in the parent once: forked ranks inherit the patched, imported xFuser.
xfuser_compat.apply()
from xfuser.model_executor.layers import usp as xf_usp  # noqa: E402

from xfuser_swiftfusion.emulation.launcher import run_emulated  # noqa: E402
from xfuser_swiftfusion.integrations import xfuser as sfx  # noqa: E402

TOPOLOGY = "2x2"              # 2 machines x 2 GPUs
HEADS, HEAD_DIM, B, S_LOCAL = 2, 8, 1, 4   # H = 2 on 4 ranks: Ulysses 2 x Ring 2
LAYERS = 2                    # attention calls per forward
BACKEND = "inductor"
TOL = 1e-5
STRATEGIES = ("tas", "torus", "swiftfusion", "auto", "usp")


class _Reference:
    """Stands in for a context: fp64 softmax attention over the whole (unsharded) sequence."""

    attention = staticmethod(reference_attention)


class TinyAttention(nn.Module):
    """Two layers of q/k/v projection, attention, output projection on ``[B, S, H*D]``.

    Attention is ``ctx.attention``, or ``xfuser_usp.USP`` (looked up at call time, as xFuser's
    processors do) when ``xfuser_usp`` (a module) is given. ``forward`` calls attention
    directly, unrolled: a graph break inside a Python loop makes Dynamo skip the whole frame,
    and one inside a nested call adds a graph per nesting level."""

    def __init__(self, ctx=None, xfuser_usp=None) -> None:
        super().__init__()
        width = HEADS * HEAD_DIM
        self.ctx, self.xfuser_usp = ctx, xfuser_usp
        self.qkv = nn.ModuleList(nn.Linear(width, 3 * width) for _ in range(LAYERS))
        self.out = nn.ModuleList(nn.Linear(width, width) for _ in range(LAYERS))

    def project(self, i: int, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``[B, S, H*D]`` -> q, k, v ``[B, H, S, D]``."""
        b, s, _ = x.shape
        q, k, v = self.qkv[i](x).view(b, s, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)
        return q.contiguous(), k.contiguous(), v.contiguous()

    def merge(self, i: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Residual plus the output projection of attention ``y`` ``[B, H, S, D]``."""
        b, s, width = x.shape
        return x + self.out[i](y.to(x.dtype).transpose(1, 2).reshape(b, s, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.project(0, x)
        y = self.ctx.attention(q, k, v) if self.xfuser_usp is None else self.xfuser_usp.USP(q, k, v)
        x = self.merge(0, x, y)
        q, k, v = self.project(1, x)
        y = self.ctx.attention(q, k, v) if self.xfuser_usp is None else self.xfuser_usp.USP(q, k, v)
        x = self.merge(1, x, y)
        return torch.tanh(x)


def _weights_and_inputs(rank: int, world: int) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """Shared weights, the global input ``[B, world*S_LOCAL, H*D]`` and this rank's shard."""
    torch.manual_seed(0)
    state = TinyAttention().state_dict()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, world * S_LOCAL, HEADS * HEAD_DIM, generator=g)
    return state, x, x[:, rank * S_LOCAL:(rank + 1) * S_LOCAL].contiguous()


def _fp64_reference(state: dict, x: torch.Tensor, rank: int) -> torch.Tensor:
    """The fp64 model over the whole sequence, this rank's rows."""
    ref = TinyAttention(_Reference()).double()
    ref.load_state_dict(state)
    return ref(x.double())[:, rank * S_LOCAL:(rank + 1) * S_LOCAL]


def _compiled_run(model: nn.Module, x: torch.Tensor) -> dict:
    """Eager, compiled (twice; the second call must not recompile) and ``explain`` of
    ``model(x)``; every rank makes the same attention calls in the same order."""
    torch._dynamo.reset()
    eager = model(x)
    compiled = torch.compile(model, backend=BACKEND)
    first = compiled(x)
    with torch.compiler.set_stance("fail_on_recompile"):
        second = compiled(x)
    explained = torch._dynamo.explain(model)(x)
    return {"eager": eager, "first": first, "second": second,
            "graphs": explained.graph_count, "breaks": explained.graph_break_count,
            "reasons": [str(r.reason) for r in explained.break_reasons]}


def _errors(run: dict, ref: torch.Tensor) -> dict:
    """Picklable summary of ``_compiled_run`` against the fp64 reference ``ref``."""
    return {"eager_vs_ref": max_abs_err(run["eager"], ref),
            "first_vs_eager": max_abs_err(run["first"], run["eager"].double()),
            "second_vs_eager": max_abs_err(run["second"], run["eager"].double()),
            "graphs": run["graphs"], "breaks": run["breaks"], "reasons": run["reasons"]}


@torch.no_grad()
def _rank_strategy(strategy: str) -> dict:
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    state, x, local = _weights_and_inputs(rank, world)
    ctx = sf.init_sequence_parallel(strategy, num_heads=HEADS, timeout_s=60)
    try:
        model = TinyAttention(ctx)
        model.load_state_dict(state)
        ctx.reset_stats()
        res = _errors(_compiled_run(model, local), _fp64_reference(state, x, rank))
        res["calls"] = ctx.stats()["calls"]
        res["strategy"] = ctx.strategy
    finally:
        ctx.close()
    return res


@torch.no_grad()
def _rank_routed_usp(strategy: str) -> dict:
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    state, x, local = _weights_and_inputs(rank, world)
    ctx = sfx.use_strategy(strategy, num_heads=HEADS)
    try:
        routed = xf_usp.USP is sfx.routed_usp
        model = TinyAttention(xfuser_usp=xf_usp)
        model.load_state_dict(state)
        ctx.reset_stats()
        res = _errors(_compiled_run(model, local), _fp64_reference(state, x, rank))
        res["calls"] = ctx.stats()["calls"]
        res["fallbacks"] = ctx.stats()["fallbacks"]
        res["routed"] = routed
    finally:
        sfx.restore_usp()
    return res


def _check(results: list[dict]) -> None:
    for rank, res in enumerate(results):
        assert res["eager_vs_ref"] < TOL, (rank, res)
        assert res["first_vs_eager"] < TOL and res["second_vs_eager"] < TOL, (rank, res)
        # one graph break per attention call, at the excluded function: LAYERS + 1 graphs
        assert (res["breaks"], res["graphs"]) == (LAYERS, LAYERS + 1), (rank, res)
        assert all("torch.compiler.disable" in r for r in res["reasons"]), (rank, res)
        # eager, two compiled calls, explain: every attention call ran on the strategy once
        assert res["calls"] == 4 * LAYERS, (rank, res)


@pytest.fixture(scope="module", autouse=True)
def _warm_inductor():
    """Load inductor and its C++ toolchain once in the parent: forked ranks inherit them
    instead of each paying the import and first-compile set-up."""
    threads = torch._inductor.config.compile_threads
    torch._inductor.config.compile_threads = 1   # no compile worker pool to fork with
    with warnings.catch_warnings():               # torch.jit deprecations inside inductor
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.compile(torch.tanh, backend=BACKEND)(torch.ones(2))
    torch._dynamo.reset()
    yield
    torch._inductor.config.compile_threads = threads


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_compiled_model_matches_eager(strategy):
    results = run_emulated(_rank_strategy, TOPOLOGY, strategy, timeout_s=240)
    _check(results)
    assert all(res["strategy"] == strategy for res in results), results


@pytest.mark.parametrize("strategy", ("torus", "usp"))
def test_compiled_model_through_routed_xfuser_usp(strategy):
    """xFuser's ``USP`` routed to ``strategy`` (``usp``: routed back to xFuser's own)."""
    results = run_emulated(_rank_routed_usp, TOPOLOGY, strategy, timeout_s=240)
    _check(results)
    for res in results:
        assert res["routed"] and res["fallbacks"] == {}, res


def test_excluded_functions_keep_their_signature():
    """The excluded functions keep name, docs and signature; ``routed_usp`` (what the router
    binds) is the excluded object."""
    import inspect
    from xfuser_swiftfusion.integrations.xfuser import routing
    for fn, name, first in ((sf.SequenceParallelContext.attention, "attention", "self"),
                            (routing.routed_usp, "routed_usp", "query")):
        assert fn.__name__ == name and fn.__doc__ and fn.__wrapped__.__doc__ == fn.__doc__
        assert next(iter(inspect.signature(fn).parameters)) == first
    assert sfx.routed_usp is routing.routed_usp


# ---------------------------------------------------------------------------------------------
# xFuser's runner with --use_torch_compile: FLUX.1 (tiny checkpoint), routed strategy, fp32
# ---------------------------------------------------------------------------------------------

RUNNER_TOPOLOGY = "1x2"       # 2 ranks: inductor compiles every graph once per rank
FLUX_ATTENTION_LAYERS = 4     # tiny Flux: 2 double + 2 single blocks


def _rank_runner_compile(strategy: str, text: int, checkpoint: str) -> dict:
    """xFuser's runner path for ``--use_torch_compile --sp-strategy <strategy>`` in fp32, as
    ``swiftfusion check --gpu-suite`` runs it on a GPU (``gpu_suite.paths.runner_compile``:
    xFuser's ``xFuserFluxModel``, its config and its own ``_compile_model``)."""
    from xfuser_swiftfusion.tools.gpu_suite.paths import runner_compile
    return runner_compile(strategy, text, checkpoint, RUNNER_TOPOLOGY)


@pytest.mark.parametrize("strategy, text", [("swiftfusion", 29), ("tas", 30)],
                         ids=["swiftfusion-text29-replicated", "tas-text30-split"])
def test_xfuser_runner_use_torch_compile(strategy, text, tiny_checkpoint_cache):
    """xFuser's runner ``--use_torch_compile`` path on tiny FLUX.1 (2 ranks): compiled latents
    equal eager within 1e-5 (relative to their largest value), no recompile after xFuser's
    warm-up, no fallback, and every graph break is at the excluded routed ``USP`` call in
    xFuser's attention processor (Dynamo restarts each enclosing frame, transformer -> block
    -> Attention -> processor, at a break inside a nested call, so explain counts more breaks
    than attention calls, all at that one site)."""
    from xfuser_swiftfusion.tools.models.tiny import tiny_checkpoint
    checkpoint = str(tiny_checkpoint("flux"))
    sfx.install()
    results = run_emulated(_rank_runner_compile, RUNNER_TOPOLOGY, strategy, text, checkpoint,
                           timeout_s=500)
    from xfuser_swiftfusion.tools.gpu_suite.paths import RUNNER_ARGS
    steps = RUNNER_ARGS["num_inference_steps"]
    for rank, res in enumerate(results):
        assert res["compiled"] and res["mode"] == "reduce-overhead", res
        assert res["text_tokens"] == text, res
        assert res["err"] <= TOL * max(1.0, res["scale"]), (rank, res)
        assert res["fallbacks"] == {}, (rank, res)
        assert res["eager_calls"] == res["calls"] == FLUX_ATTENTION_LAYERS * steps, (rank, res)
        assert res["breaks"] >= FLUX_ATTENTION_LAYERS, (rank, res)
        assert all("torch.compiler.disable" in r for r in res["reasons"]), (rank, res)
        assert res["break_sites"] and all(
            site.endswith("transformer_flux.py:hidden_states = USP(")
            for site in res["break_sites"]), (rank, res)
