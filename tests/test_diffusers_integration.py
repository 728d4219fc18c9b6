"""diffusers' own context parallelism with SwiftFusion strategies (``integrations.diffusers``).

Every diffusers 0.42 model with a ``_cp_plan`` is built tiny with random weights and the
masks its pipeline passes (``support.diffusers_models``), batch 1 and 2; its single-device
forward (plain diffusers, before anything is enabled) is the reference. One emulated launch
per topology runs every model under every strategy: 2x2 with 4 heads (mesh U4xR1: torus 2 x
intra-Ulysses 2), 1x4 with 2 heads (U2xR2 inside one machine), 4x1 with 4 heads (torus 4),
2x2 with 2 heads (U2xR2: a ring of 2 inside each machine). fp32 whole-transformer
outputs must match within ``TOL``; each attention call must take the path its tokens call
for (``EXPECTED_PATHS``). The same launches check routed ``dispatch_attention_fn`` calls
against an fp64 reference: grouped-query heads, every mask form diffusers passes, masks that
are not key masks, and the paths of replicated queries or keys/values.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

diffusers = pytest.importorskip("diffusers")
from diffusers import ContextParallelConfig  # noqa: E402
from diffusers.models.attention_dispatch import (_AttentionBackendRegistry,  # noqa: E402
                                                 dispatch_attention_fn)

from support.diffusers_models import MODELS, build, forward  # noqa: E402
from xfuser_swiftfusion.emulation.launcher import run_emulated  # noqa: E402
from xfuser_swiftfusion.integrations import diffusers as sfd  # noqa: E402
from xfuser_swiftfusion.integrations.diffusers import (masks, plans, routing,  # noqa: E402
                                                       sharding, sites)

STRATEGIES = ("tas", "torus", "swiftfusion", "auto")
TOL = 1e-5          # fp32, whole transformer output and single attention calls
# launch -> (topology, heads, its mesh)
LAUNCHES = {"2x2": ("2x2", 4, "U4xR1"), "1x4": ("1x4", 2, "U2xR2"), "4x1": ("4x1", 4, "U4xR1"),
            "2x2-ring": ("2x2", 2, "U2xR2")}
CASES = [(name, batch) for name in MODELS for batch in (1, 2)
         if (name, batch) != ("qwenimage+ones", 2)]  # batch 2 of Qwen-Image has its own mask
# attention calls of one forward per path (routing.PATHS); "key-masked": strategy calls
# with a key mask (all-ones masks run unmasked)
_SELF = lambda n, masked=0: {"strategy": n, "key-masked": masked}  # noqa: E731
EXPECTED_PATHS = {
    "flux": _SELF(2), "flux2": _SELF(2), "wan": _SELF(2), "chronoedit": _SELF(2),
    "helios": _SELF(2), "qwenimage": _SELF(2), "qwenimage+ones": _SELF(2),
    ("qwenimage", 2): _SELF(2, masked=2),
    # video self-attention on the strategy; the text cross-attention on all-gathered text
    "ltx": {"strategy": 1, "gathered": 1},
    # + audio self-attention, audio -> text and video -> audio local; audio -> video merged
    "ltx2": {"strategy": 1, "local": 3, "merged": 1, "gathered": 1},
    "minimax_h3": {"strategy": 2, "local": 1},     # the text refiner runs before the split
}
# diffusers' own Ulysses fails on these (0.42.1): a [B, H, 1, T] text mask meets H / W heads
# after the all-to-all; LTX-2 also lacks cross_attn_rope in its plan
DIFFUSERS_OWN_FAILS = {"ltx", "ltx2"}


def expected_paths(name: str, batch: int) -> dict:
    paths = EXPECTED_PATHS.get((name, batch), EXPECTED_PATHS[name])
    return {p: n for p, n in paths.items() if n}


# ---------------------------------------------------------------------------------------------
# what every rank runs
# ---------------------------------------------------------------------------------------------

def _reference(q, k, v, bias=None) -> torch.Tensor:
    """fp64 attention ``[B, S_q, H, D]`` of ``[B, S, H(_kv), D]`` inputs; ``bias``: additive
    float or bool (True = attend) mask broadcast to ``[B, H, S_q, S_kv]``."""
    q, k, v = (x.double().transpose(1, 2) for x in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if bias is not None:
        if bias.dtype == torch.bool:
            bias = torch.zeros(bias.shape, dtype=torch.float64).masked_fill(~bias, float("-inf"))
        scores = scores + bias.double()
    return (torch.softmax(scores, -1) @ v).transpose(1, 2)


def _op_checks(model) -> dict:
    """Routed ``dispatch_attention_fn`` calls against ``_reference``: for each case, the max
    error, the fallback reasons it added, the K/V heads and key mask the strategy received,
    or the error it raised."""
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    config, ctx = model._parallel_config, sfd.context_of(model)
    B, S, H, D = 2, 8, ctx.num_heads, 8
    L = S * world
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(B, L, H, D, generator=g) for _ in range(3))
    k, v = k[:, :, :H // 2], v[:, :, :H // 2]     # grouped-query: H / 2 K/V heads
    part = slice(rank * S, (rank + 1) * S)
    keys = torch.rand(B, L, generator=g) > 0.3
    keys[:, 0] = True                               # every row keeps a key
    additive = torch.zeros(B, L).masked_fill(~keys, float("-inf"))
    per_query = torch.rand(B, 1, S, L, generator=g) > 0.3  # by local query row, global key
    per_query[..., 0] = True
    bias = torch.randn(B, 1, 1, L, generator=g)
    divergent = keys[:, None, None, :].expand(B, 1, S, L).clone()
    divergent[..., :S] = per_query[..., :S]       # rank 0's keys vary along queries
    rows = keys[:, None, None, :].expand(B, 1, L, L).clone()  # a mask over every query and key
    rows[:, :, 2 * S:3 * S] = per_query            # rank 2's query rows vary
    cases = {  # name -> (mask this rank passes, the whole mask the reference applies)
        "gqa": (None, None),
        "bool [B, S]": (keys[:, part], keys[:, None, None, :]),
        "bool [B, 1, 1, S]": (keys[:, None, None, part], keys[:, None, None, :]),
        "-inf [B, 1, 1, S]": (additive[:, None, None, part], additive[:, None, None, :]),
        "-1e4 [B, H, 1, S]": ((~keys[:, None, None, part]).float().mul(-1e4).expand(B, H, 1, S)
                              .contiguous(), keys[:, None, None, :]),
        "bool [B, 1, S_q, S]": (keys[:, None, None, part].expand(B, 1, S, S).contiguous(),
                                keys[:, None, None, :]),
        "whole [B, 1, 1, L]": (keys[:, None, None, :], keys[:, None, None, :]),
        "ones": (torch.ones(B, 1, 1, S, dtype=torch.bool), None),
        "per query": (per_query[..., part], per_query),
        "bias": (bias[..., part], bias),
        "divergent": (divergent[..., part], divergent),
        "whole rows": (rows, rows[:, :, part]),
    }
    seen: list = []
    attention = ctx.attention

    def spy(*args, **kwargs):
        seen.append((args[1].shape[1], kwargs.get("key_mask")))
        return attention(*args, **kwargs)

    ctx.attention = spy
    out: dict = {}
    try:
        with torch.no_grad():
            for name, (mask, whole) in cases.items():
                before, seen[:] = dict(ctx.fallbacks), []
                got = dispatch_attention_fn(q[:, part], k[:, part], v[:, part], attn_mask=mask,
                                            enable_gqa=True, parallel_config=config)
                ref = _reference(q[:, part], k, v, whole)
                out[name] = {"err": (got - ref).abs().max().item(),
                             "fallbacks": {r: n - before.get(r, 0) for r, n in ctx.fallbacks.items()
                                           if n != before.get(r, 0)},
                             "kv_heads": [h for h, _ in seen],
                             "key_mask": [None if m is None else tuple(m.shape) for _, m in seen]}
            for name, mask, causal in (("causal", None, True),
                                       ("shape", torch.ones(B, 1, 1, S + 1, dtype=torch.bool), False)):
                try:
                    dispatch_attention_fn(q[:, part], k[:, part], v[:, part], attn_mask=mask,
                                          is_causal=causal, enable_gqa=True, parallel_config=config)
                    out[name] = "ran"
                except routing.UnsupportedAttention as exc:
                    out[name] = str(exc)
            # replicated queries over sharded keys (merged), replicated keys/values (local)
            for name, site, kv_part in (("merged", sites.Site(False, True), part),
                                        ("local", sites.Site(True, False), slice(None))):
                token = sites._current.set(site)
                try:
                    for masked in (False, True):
                        mask = keys[:, None, None, kv_part] if masked else None
                        got = dispatch_attention_fn(q[:, :S], k[:, kv_part], v[:, kv_part],
                                                    attn_mask=mask, enable_gqa=True,
                                                    parallel_config=config)
                        ref = _reference(q[:, :S], k, v, keys[:, None, None, :] if masked else None)
                        out[name, masked] = (got - ref).abs().max().item()
                finally:
                    sites._current.reset(token)
    finally:
        del ctx.attention
    return out


def _run_case(res: dict, name: str, batch: int, heads: int) -> None:
    model, inputs = build(name, heads, batch)
    ref = forward(model, inputs)
    for strategy in STRATEGIES:
        ctx = sfd.enable_parallelism(model, strategy)
        try:
            out = forward(model, inputs)
            res["fallbacks"][name, batch, strategy] = ctx.stats()["fallbacks"]
            res["paths"][name, batch, strategy] = sfd.attention_paths(model)
            if (name, batch, strategy) == ("flux", 1, "tas"):
                res["ops"] = _op_checks(model)
        finally:
            sfd.disable_parallelism(model)
        res["errors"][name, batch, strategy] = (out - ref).abs().max().item()
        res["mesh"][name, batch, strategy] = ctx.mesh.describe()
    res["errors"][name, batch, "disabled"] = (forward(model, inputs) - ref).abs().max().item()
    if res["own"] is not None and batch == 1 and name not in DIFFUSERS_OWN_FAILS:
        # the harness's sanity: diffusers' own Ulysses over the same ranks (on the plan fitted
        # to the model: Helios' names 40 blocks), then adopted
        import torch.distributed as dist
        with sharding.accelerator_count_at_least_one():
            model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=dist.get_world_size()),
                                     cp_plan=plans.plan_for(model))
        res["own"][name, "diffusers"] = (forward(model, inputs) - ref).abs().max().item()
        ctx = sfd.enable_parallelism(model, "swiftfusion")
        res["own"][name, "adopted"] = (forward(model, inputs) - ref).abs().max().item()
        res["own"][name, "adopted-paths"] = sfd.attention_paths(model)
        sfd.disable_parallelism(model)
        res["own"][name, "diffusers-again"] = (forward(model, inputs) - ref).abs().max().item()


def _rank_run(heads: int, own: bool) -> dict:
    res: dict = {"errors": {}, "mesh": {}, "fallbacks": {}, "paths": {}, "own": {} if own else None}
    for name, batch in CASES:
        _run_case(res, name, batch, heads)
    res["registry_restored"] = not any(hasattr(fn, routing._WRAPPED_ATTR)
                                       for fn in _AttentionBackendRegistry._backends.values())
    model, inputs = build("flux", heads)
    inputs = dict(inputs, encoder_hidden_states=inputs["encoder_hidden_states"][:, :7],
                  txt_ids=inputs["txt_ids"][:7])
    sfd.enable_parallelism(model, "torus")
    try:
        forward(model, inputs)
        res["uneven"] = "ran"
    except ValueError as exc:
        res["uneven"] = str(exc)
    finally:
        sfd.disable_parallelism(model)
    return res


_launches: dict = {}


def launch(name: str) -> list[dict]:
    """Per-rank results of one emulated launch (run once, on first use)."""
    if name not in _launches:
        topology, heads, _ = LAUNCHES[name]
        _launches[name] = run_emulated(_rank_run, topology, heads, name == "2x2", timeout_s=600)
    return _launches[name]


# ---------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("launch_name", list(LAUNCHES))
@pytest.mark.parametrize("name,batch", CASES)
def test_every_strategy_matches_single_device(launch_name, name, batch):
    ranks = launch(launch_name)
    mesh = LAUNCHES[launch_name][2]
    for strategy in STRATEGIES:
        errs = [r["errors"][name, batch, strategy] for r in ranks]
        assert max(errs) <= TOL, (name, batch, strategy, errs)
        assert ranks[0]["mesh"][name, batch, strategy].startswith(mesh), \
            ranks[0]["mesh"][name, batch, strategy]
    assert max(r["errors"][name, batch, "disabled"] for r in ranks) == 0.0  # disable restores


@pytest.mark.parametrize("launch_name", list(LAUNCHES))
@pytest.mark.parametrize("name,batch", CASES)
def test_each_call_takes_its_path_and_masked_self_attention_never_falls_back(launch_name, name,
                                                                            batch):
    """Self-attention, masked or not, runs on the strategy (an all-ones mask unmasked); only
    LTX's and LTX-2's text cross-attention over sharded text gathers that text."""
    for rank in launch(launch_name):
        for strategy in STRATEGIES:
            assert rank["paths"][name, batch, strategy] == expected_paths(name, batch), \
                (name, batch, strategy, rank["paths"][name, batch, strategy])
            gathered = expected_paths(name, batch).get("gathered", 0)
            expected = {routing.CROSS_ATTENTION: gathered} if gathered else {}
            assert rank["fallbacks"][name, batch, strategy] == expected, \
                (name, batch, strategy, rank["fallbacks"][name, batch, strategy])


def test_diffusers_own_context_parallelism_matches_and_is_adopted():
    own = launch("2x2")[0]["own"]
    for name in (n for n in MODELS if n not in DIFFUSERS_OWN_FAILS):
        assert own[name, "diffusers"] <= TOL, (name, own[name, "diffusers"])
        assert own[name, "adopted"] <= TOL, (name, own[name, "adopted"])
        assert own[name, "adopted-paths"] == expected_paths(name, 1), own[name, "adopted-paths"]
        assert own[name, "diffusers-again"] <= TOL  # disable leaves diffusers' own CP on


@pytest.mark.parametrize("launch_name", list(LAUNCHES))
def test_masks_grouped_query_and_replicated_tokens_at_the_dispatch(launch_name):
    S, B = 8, 2
    heads = LAUNCHES[launch_name][1]
    for rank in launch(launch_name):
        ops = rank["ops"]
        key_masked = [(B, 4 * S)]
        for name, masked in (("gqa", None), ("bool [B, S]", key_masked),
                             ("bool [B, 1, 1, S]", key_masked), ("-inf [B, 1, 1, S]", key_masked),
                             ("-1e4 [B, H, 1, S]", key_masked), ("bool [B, 1, S_q, S]", key_masked),
                             ("whole [B, 1, 1, L]", key_masked), ("ones", [None])):
            # on the strategy, K/V with their own heads, the key mask as [B, L] (or none)
            assert ops[name]["err"] <= TOL, (name, ops[name])
            assert ops[name]["fallbacks"] == {}, (name, ops[name])
            assert ops[name]["kv_heads"] == [heads // 2], (name, ops[name])
            assert ops[name]["key_mask"] == (masked or [None]), (name, ops[name])
        for name, reason in (("per query", masks.VERDICTS[masks._VARIES]),
                             ("bias", masks.VERDICTS[masks._BIAS]),
                             ("divergent", masks.VERDICTS[masks._VARIES]),
                             ("whole rows", masks.VERDICTS[masks._VARIES])):
            # every rank falls back together (rank 0's verdict alone in "divergent", rank 2's
            # rows of a mask every rank holds in "whole rows"), exact
            assert ops[name]["err"] <= TOL, (name, ops[name])
            assert ops[name]["fallbacks"] == {reason: 1} and ops[name]["kv_heads"] == [], \
                (name, ops[name])
        assert "causal" in ops["causal"], ops["causal"]
        assert "S_kv=8" in ops["shape"] and "(2, 1, 1, 9)" in ops["shape"], ops["shape"]
        for path in ("merged", "local"):
            assert ops[path, False] <= TOL and ops[path, True] <= TOL, ops


@pytest.mark.parametrize("launch_name", list(LAUNCHES))
def test_registry_restored_and_uneven_lengths_named(launch_name):
    for rank in launch(launch_name):
        assert rank["registry_restored"]
        assert "not divisible by 4" in rank["uneven"] and "<model>: txt_ids" in rank["uneven"], \
            rank["uneven"]


def test_fallback_reasons():
    q = torch.zeros(1, 8, 4, 2)
    base = dict(query=q, key=q, value=q, attn_mask=None, dropout_p=0.0, is_causal=False,
                scale=None, enable_gqa=False, _parallel_config=None)
    assert routing.fallback_reason(base, 4) is None
    assert routing.fallback_reason(dict(base, key=q[:, :3], value=q[:, :3]), 4) == \
        routing.CROSS_ATTENTION
    assert routing.fallback_reason(dict(base, attn_mask=torch.ones(1, 8)), 4) is None  # masks run
    assert routing.fallback_reason(dict(base, key=q[:, :, :2]), 4) is None   # GQA runs
    assert "heads" in routing.fallback_reason(base, 8)
    assert "key/value heads" in routing.fallback_reason(dict(base, key=q[:, :, :3]), 4)
    assert routing.fallback_reason(dict(base, return_lse=True), 4) == "return_lse=True"
    with pytest.raises(routing.UnsupportedAttention, match="causal"):
        routing.fallback_reason(dict(base, is_causal=True), 4)


def test_mask_forms_read_as_key_masks():
    """``masks.localize`` / ``key_mask_and_verdict`` on one rank: every form diffusers passes,
    read without expanding; a mask of another extent is named."""
    B, H, S_q, S_kv, W = 2, 4, 3, 5, 4
    keys = torch.rand(B, S_kv) > 0.5
    forms = {"[B, S_kv]": keys, "[B, 1, 1, S_kv]": keys[:, None, None],
             "[B, H, S_q, S_kv] stride 0": keys[:, None, None].expand(B, H, S_q, S_kv),
             "[1, 1, S_kv] per-batch": keys[:1, None],
             "additive": torch.zeros(B, S_kv).masked_fill(~keys, float("-inf")),
             "bf16 -10000 (LTX's)": ((1 - keys.to(torch.bfloat16)) * -10000.0)[:, None, None]}
    for name, mask in forms.items():
        local = masks.localize(mask, B, H, S_q, S_kv, W, 1)
        assert not local.whole, name
        got, code = masks.key_mask_and_verdict(local.m, B)
        want = keys[:1].expand(B, -1) if "per-batch" in name else keys
        assert int(code) == masks._OK and torch.equal(got, want), name
    whole = masks.localize(torch.ones(B, 1, W * S_q, W * S_kv), B, H, S_q, S_kv, W, 2)
    assert whole.whole and whole.m.shape == (B, 1, S_q, W * S_kv)  # this rank's query rows
    varies = torch.zeros(B, 1, S_q, S_kv)
    varies[0, 0, 1, 2] = float("-inf")
    assert int(masks.key_mask_and_verdict(masks.localize(varies, B, H, S_q, S_kv, W, 0).m, B)[1]) \
        == masks._VARIES
    with pytest.raises(masks.MaskShapeError, match=r"\(2, 1, 1, 6\)"):
        masks.localize(torch.ones(B, 1, 1, S_kv + 1), B, H, S_q, S_kv, W, 0)


def test_plans_naming_more_blocks_are_trimmed_and_unknown_modules_refused(caplog):
    """Helios' plan names blocks 0-39: a 2-block model keeps the entries of its blocks (and
    the wildcard splits); a key naming a module the model lacks is refused by name."""
    model, _ = build("helios", 2)
    plan = plans.plan_for(model)
    assert "blocks.1.attn1" in plan and "blocks.2.attn1" not in plan and "blocks.*.ffn" in plan
    assert len(plan) == 3 + 3 * 2
    with pytest.raises(plans.PlanError, match=r"HeliosTransformer3DModel's cp_plan names "
                                              r"'blocks.\*.nope'.*no submodule 'nope'"):
        plans.plan_for(model, {"blocks.*.nope": {}})
    assert plans.plan_for(model, {"blocks.7": {}}) == {}


def test_strategies_that_need_xfuser_groups_are_refused():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="xFuser's process groups"):
        sfd.enable_parallelism(model, "usp")
    with pytest.raises(ValueError, match="unknown strategy"):
        sfd.enable_parallelism(model, "nope")


def test_importing_the_integration_imports_no_diffusers():
    code = ("import sys; import xfuser_swiftfusion.integrations.diffusers; "
            "print([m for m in ('diffusers', 'xfuser') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr[-2000:]


@pytest.mark.parametrize("example,strategy", [("diffusers_flux_example.py", "swiftfusion"),
                                              ("diffusers_wan_example.py", "torus")])
def test_diffusers_example_runs_as_the_readme_says(example, strategy):
    """The README's CPU commands for the diffusers examples (own process, --emulate 2x2): the
    strategy runs every attention call without a fallback and the latents equal the
    single-device run; no per-rank warnings in the output."""
    from pathlib import Path
    script = Path(__file__).resolve().parents[1] / "examples" / example
    res = subprocess.run([sys.executable, str(script), "--emulate", "2x2", "--strategy", strategy,
                          "--steps", "2"], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout + res.stderr
    assert f"strategy {strategy}" in out and "fallbacks [{}]" in out, out[-3000:]
    err = float(re.search(r"max \|latents - single device\|: ([0-9.e+-]+)", out).group(1))
    assert err < 1e-4, out[-3000:]
    assert "FutureWarning" not in out, out[-3000:]
