"""SGLang's ``USPAttention`` with its forward hooked onto our strategies: exact against the fp64
single-device reference and against SGLang's own USP (Ulysses; its Ring has no CPU backend), on
emulated 2x2, 4x1 and 2x4, for plain self-attention, a replicated text prefix and suffix, and GQA;
unsupported calls run SGLang's path and are counted."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from support import sglang_env

_reason = sglang_env.absent()
if _reason:
    pytest.skip(_reason, allow_module_level=True)

import torch.distributed as dist  # noqa: E402

from support import reference, sglang_ranks  # noqa: E402
from xfuser_swiftfusion.emulation.launcher import run_emulated  # noqa: E402

B, H, D, S, TEXT = 2, 8, 16, 6, 5
STRATEGIES = ("swiftfusion", "torus", "tas", "auto")
# (name, K/V heads, text rows, where)
CASES = (("plain", H, 0, None), ("prefix", H, TEXT, "front"), ("suffix", H, TEXT, "rear"),
         ("gqa", H // 2, 0, None), ("gqa-prefix", H // 2, TEXT, "front"))


def _inputs(world: int, kv_heads: int, text: int, seed: int = 0):
    """Global image q, k, v ``[B, L, H(kv), D]`` and text ``[B, T, H(kv), D]``."""
    g = torch.Generator().manual_seed(seed)
    L = world * S
    q, k, v = (torch.randn(B, L, h, D, generator=g) for h in (H, kv_heads, kv_heads))
    tq, tk, tv = (torch.randn(B, text, h, D, generator=g) for h in (H, kv_heads, kv_heads))
    return (q, k, v), (tq, tk, tv)


def _local(image, text, where, rank, world):
    """The rank's SGLang inputs ``[B, S(+T), H, D]``: its image rows, the text in front or rear."""
    rows = slice(rank * S, (rank + 1) * S)
    out = []
    for x, t in zip(image, text):
        x = x[:, rows]
        out.append(x if t.shape[1] == 0 else torch.cat([t, x] if where == "front" else [x, t], 1))
    return out


def _layers():
    from sglang.multimodal_gen.runtime.layers.attention.layer import USPAttention
    return {kv: USPAttention(num_heads=H, head_size=D, num_kv_heads=kv) for kv in (H, H // 2)}


def _run_cases(layers, rank, world, sglang_baseline=False):
    outs = {}
    with sglang_ranks.forward_context():
        for name, kv, text, where in CASES:
            if sglang_baseline and kv % world:
                continue  # SGLang's Ulysses exchange needs K/V heads divisible by the SP degree
            image, txt = _inputs(world, kv, text)
            q, k, v = _local(image, txt, where, rank, world)
            kwargs = {}
            if where == "front":
                kwargs["num_replicated_prefix"] = text
            elif where == "rear":
                kwargs["num_replicated_suffix"] = text
            outs[name] = layers[kv](q, k, v, **kwargs)
    return outs


def _rank(strategies):
    from xfuser_swiftfusion.integrations import sglang as sfs
    sglang_ranks.setup()
    rank, world = dist.get_rank(), dist.get_world_size()
    layers = _layers()
    results = {"sglang": _run_cases(layers, rank, world, sglang_baseline=True)}
    # a key mask is not taken by our strategies: SGLang's path runs it, counted once
    image, _ = _inputs(world, H, 0, seed=1)
    q, k, v = (x[:, rank * S:(rank + 1) * S] for x in image)
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[:, -1] = rank % 2 == 0
    with sglang_ranks.forward_context():
        masked = {"sglang": layers[H](q, k, v, attn_mask=mask)}
        sfs.install(strategies[0])
        try:
            masked["hooked"] = layers[H](q, k, v, attn_mask=mask)
            masked["fallbacks"] = {h: c.stats()["fallbacks"] for h, c in sfs.active().items()}
        finally:
            sfs.uninstall()
    results["masked"] = masked
    stats = {}
    for strategy in strategies:
        sfs.install(strategy)
        try:
            results[strategy] = _run_cases(layers, rank, world)
            stats[strategy] = {h: c.stats() for h, c in sfs.active().items()}
        finally:
            sfs.uninstall()
    sglang_ranks.teardown()
    return results, stats


def _reference(name, kv, text, where, rank, world):
    image, txt = _inputs(world, kv, text)
    q, k, v = (x.transpose(1, 2) for x in image)
    joint = tuple(t.transpose(1, 2) for t in txt) if text else None
    return reference.rank_rows(q, k, v, rank, world, joint, where or "front").transpose(1, 2)


TOPOLOGIES = ("2x2", "4x1", "2x4")


def emulate(topology: str):
    """Every rank's results on ``topology`` (runs in the SGLang child process)."""
    return run_emulated(_rank, topology, STRATEGIES, timeout_s=240)


def _cfg_rank(strategy: str):
    """SGLang's CFG parallelism: two halves of the world, each its own SP group (one machine of
    2x4 each); each half attends over its own inputs."""
    from sglang.multimodal_gen.runtime.distributed import parallel_state as ps
    from xfuser_swiftfusion.integrations import sglang as sfs
    sglang_ranks.setup(cfg=2)
    group = ps.get_sp_group()
    r, w = group.rank_in_group, group.world_size
    image, _ = _inputs(w, H, 0, seed=dist.get_rank() // w)
    q, k, v = (x[:, r * S:(r + 1) * S] for x in image)
    layer = _layers()[H]
    sfs.install(strategy)
    try:
        with sglang_ranks.forward_context():
            out = layer(q, k, v)
        stats = {h: (c.calls, c.stats()["fallbacks"], str(c.topology)) for h, c in sfs.active().items()}
    finally:
        sfs.uninstall()
    sglang_ranks.teardown()
    return out, stats, r, w


def emulate_cfg():
    return run_emulated(_cfg_rank, "2x4", "torus", timeout_s=240)


@pytest.fixture(scope="module")
def runs(sglang_child):
    """All topologies in the session's SGLang child (the pytest process imports no SGLang)."""
    jobs = [(Path(__file__).stem, "emulate", (t,)) for t in TOPOLOGIES]
    results = sglang_child.run(jobs + [(Path(__file__).stem, "emulate_cfg", ()),
                                       ("test_compare_sglang", "compare_jobs", ())])
    return {**dict(zip(TOPOLOGIES, results)), "cfg": results[-2], "compare": results[-1]}


def test_cfg_parallel_halves(runs):
    """With CFG parallelism each SP group (one machine) runs the strategy on its own inputs."""
    for rank, (out, stats, r, w) in enumerate(runs["cfg"]):
        image, _ = _inputs(w, H, 0, seed=rank // w)
        ref = reference.rank_rows(*(x.transpose(1, 2) for x in image), r, w).transpose(1, 2)
        assert reference.max_abs_err(out, ref) < 1e-5, rank
        assert stats == {H: (1, {}, "1x4")}, stats


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_wrapped_uspattention_exact(runs, topology):
    world = int(topology[0]) * int(topology[2])
    per_rank = runs[topology]
    for rank, (results, stats) in enumerate(per_rank):
        for name, kv, text, where in CASES:
            ref = _reference(name, kv, text, where, rank, world)
            ours = {s: results[s][name] for s in STRATEGIES}
            baseline = results["sglang"].get(name)
            if baseline is not None:
                ours["sglang-usp"] = baseline
            for who, out in ours.items():
                assert out.shape == ref.shape, (topology, rank, name, who)
                err = reference.max_abs_err(out, ref)
                assert err < 1e-5, f"{topology} rank {rank} {name} {who}: {err:.2e}"
            if baseline is not None:
                for s in STRATEGIES:
                    diff = (results[s][name] - baseline).abs().max().item()
                    assert diff < 1e-5, f"{topology} rank {rank} {name} {s} vs SGLang USP: {diff:.2e}"
        masked = results["masked"]
        assert torch.equal(masked["hooked"], masked["sglang"]), (topology, rank)
        assert masked["fallbacks"] == {H: {"attention mask": 1}}, masked["fallbacks"]
        for strategy in STRATEGIES:
            for heads, st in stats[strategy].items():
                assert st["fallbacks"] == {}, (topology, strategy, st["fallbacks"])
                assert st["calls"] > 0


def test_compare_engine_sglang(runs):
    """``swiftfusion compare --engine sglang`` on 2x2 (run in this module's SGLang child: one
    import); its checks are ``test_compare_sglang.check_fast``."""
    from test_compare_sglang import check_fast
    check_fast(runs["compare"])
