"""Grouped-query attention (K/V with fewer heads) and key-padding masks, run natively by every
core strategy (tas, torus, swiftfusion, auto) and by the local kernels.

The reference is ``support.reference`` (fp64, GQA by indexing the K/V head ``i // rep``, the
mask by -inf scores; rows without an unmasked key output 0), independent of the package.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import xfuser_swiftfusion as sf
from xfuser_swiftfusion.emulation.launcher import run_emulated
from xfuser_swiftfusion.kernels import attend, new_state
from xfuser_swiftfusion.strategies.layout import InputError, kv_heads_for
from support.reference import attention, attention_lse, max_abs_err, rank_rows

from xfuser_swiftfusion.strategies.registry import specs

specs()  # load the entry-point strategies (auto's candidates) once, before ranks fork
STRATS = ("tas", "torus", "swiftfusion", "auto")
TOL = 1e-5


# --- kernels ---------------------------------------------------------------------------------

def _rand_chunks(g, B, H, Hkv, D, q_lens, kv_lens):
    q = [torch.randn(B, H, n, D, generator=g) for n in q_lens]
    kv = [(torch.randn(B, Hkv, n, D, generator=g), torch.randn(B, Hkv, n, D, generator=g))
          for n in kv_lens]
    return q, kv


@pytest.mark.parametrize("H,Hkv", [(6, 2), (6, 3), (4, 1), (4, 4)])
def test_cpu_kernel_gqa_and_mask(H, Hkv):
    g = torch.Generator().manual_seed(H * 10 + Hkv)
    B, D = 3, 16
    q, kv = _rand_chunks(g, B, H, Hkv, D, (5, 0, 9), (7, 3, 0, 4))
    masks = [torch.rand(B, n, generator=g) > 0.4 for n in (7, 3, 0, 4)]
    masks[1] = None  # a chunk without a mask: every key attends
    masks[0][1] = False  # batch 1: chunk 0 fully masked (its partial LSE is -inf)
    masks[3][1] = False
    masks[0][2] = masks[3][2] = False  # batch 2: keys only in the unmasked chunk 1
    K, V = (torch.cat([c[i] for c in kv], 2) for i in (0, 1))
    M = torch.cat([torch.ones(B, 3, dtype=torch.bool) if m is None else m for m in masks], 1)
    states = [new_state(x) for x in q]
    attend(q, kv[:2], states, scale=0.3, key_masks=masks[:2])  # two calls: merged states
    outs = attend(q, kv[2:], states, scale=0.3, key_masks=masks[2:], finalize=True)
    for o, x, st in zip(outs, q, states):
        if x.shape[2] == 0:
            assert o.shape == x.shape
            continue
        ref, lse = attention_lse(x, K, V, 0.3, M)
        assert max_abs_err(o, ref) <= TOL
        assert torch.allclose(st.lse().double(), lse, atol=1e-5)
    # without masks: GQA alone
    states = [new_state(x) for x in q]
    outs = attend(q, kv, states, scale=0.3, finalize=True)
    for o, x in zip(outs, q):
        if x.shape[2]:
            assert max_abs_err(o, attention(x, K, V, 0.3)) <= TOL


def test_cpu_kernel_fully_masked_rows_output_zero():
    """Rows with every key masked: output 0 (as torch's SDPA), LSE -inf, no NaN."""
    g = torch.Generator().manual_seed(5)
    q, kv = _rand_chunks(g, 2, 4, 2, 8, (6,), (5, 3))
    masks = [torch.ones(2, 5, dtype=torch.bool), torch.ones(2, 3, dtype=torch.bool)]
    masks[0][0] = masks[1][0] = False  # batch 0: nothing attends
    st = [new_state(q[0])]
    (out,) = attend(q, kv, st, scale=0.5, key_masks=masks, finalize=True)
    assert out[0].abs().max() == 0 and not out.isnan().any()
    assert torch.isinf(st[0].lse()[0]).all()
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q[0], kv[0][0].repeat_interleave(2, 1), kv[0][1].repeat_interleave(2, 1),
        attn_mask=masks[0][:, None, None, :], scale=0.5)
    assert sdpa[0].abs().max() == 0  # the convention we match
    K, V = (torch.cat([c[i] for c in kv], 2) for i in (0, 1))
    assert max_abs_err(out, attention(q[0], K, V, 0.5, torch.cat(masks, 1))) <= TOL


def test_kernel_rejects_bad_gqa_and_masks():
    q = [torch.randn(1, 6, 4, 8)]
    st = [new_state(q[0])]
    with pytest.raises(ValueError, match="H_kv dividing"):
        attend(q, [(torch.randn(1, 4, 3, 8),) * 2], st, scale=1.0)
    with pytest.raises(ValueError, match="key mask"):
        attend(q, [(torch.randn(1, 2, 3, 8),) * 2], st, scale=1.0,
               key_masks=[torch.ones(1, 4, dtype=torch.bool)])


def test_kv_heads_for():
    assert kv_heads_for(24, 8, 4) == 8      # Lumina2 on 4 head groups: unexpanded
    assert kv_heads_for(24, 8, 8) == 8
    assert kv_heads_for(12, 6, 4) == 12     # 6 K/V heads do not split in 4: 12
    assert kv_heads_for(8, 1, 4) == 4       # MQA
    assert kv_heads_for(12, 3, 2) == 6


# --- strategies on emulated clusters -----------------------------------------------------------

def _case(i, H, Hkv, U=None, B=2, S=6, D=16, Tj=0, where="front", mask=None, text_mask=False):
    return dict(id=i, H=H, Hkv=Hkv, U=U, B=B, S=S, D=D, Tj=Tj, where=where, mask=mask,
                text_mask=text_mask)


def _make_mask(kind, B, L, S, world, g):
    """bool [B, L]: ``random``; ``chunks``: random with whole ranks' tokens masked per batch
    entry; ``rows``: batch 0 fully masked; ``krea``: text + image valid prefix then padding."""
    if kind is None:
        return None
    m = torch.rand(B, L, generator=g) > 0.35
    if kind in ("chunks", "rows"):
        for b in range(B):
            for r in range(world):
                if (b + r) % 2 == 0:
                    m[b, r * S:(r + 1) * S] = False  # every key of rank r masked for batch b
        m[:, -1] = True  # at least one key left per batch entry
    if kind == "rows":
        m[0] = False
    if kind == "krea":  # [text valid | text pad | image | SP pad], per batch entry
        m = torch.ones(B, L, dtype=torch.bool)
        for b in range(B):
            m[b, 2 + b:5] = False
        m[:, L - 3:] = False
    return m


def _gqa_mask_rank(cases, strategies):
    """Every case x strategy on this rank: [(case id, strategy, ran as, err, inter bytes)]."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for c in cases:
        B, H, Hkv, S, D, Tj = (c[k] for k in ("B", "H", "Hkv", "S", "D", "Tj"))
        L = S * world
        g = torch.Generator().manual_seed(c["id"] * 7919 + H)
        q = torch.randn(B, H, L, D, generator=g)
        k, v = (torch.randn(B, Hkv, L, D, generator=g) for _ in range(2))
        jq = torch.randn(B, H, Tj, D, generator=g)
        jk, jv = (torch.randn(B, Hkv, Tj, D, generator=g) for _ in range(2))
        mask = _make_mask(c["mask"], B, L, S, world, g)
        tmask = None
        if c["text_mask"]:
            tmask = torch.rand(B, Tj, generator=g) > 0.5
            tmask[0] = False  # batch 0: no text key attends
        mine = slice(rank * S, (rank + 1) * S)
        joint = (dict(joint_query=jq, joint_key=jk, joint_value=jv, joint_strategy=c["where"])
                 if Tj else {})
        ref = rank_rows(q, k, v, rank, world, (jq, jk, jv) if Tj else None, c["where"],
                        key_mask=mask, joint_key_mask=tmask)
        # negative control: K/V heads tiled (query head i -> K/V head i % H_kv), no masks
        tile = lambda x: x.repeat(1, H // Hkv, 1, 1)  # noqa: E731
        wrong = rank_rows(q, tile(k), tile(v), rank, world,
                          (jq, tile(jk), tile(jv)) if Tj else None, c["where"])
        for name in strategies:
            ctx = sf.init_sequence_parallel(name, H, timeout_s=60, ulysses_degree=c["U"])
            try:
                out = ctx.attention(q[:, :, mine], k[:, :, mine], v[:, :, mine], **joint,
                                    kv_head_repeat=H // Hkv, key_mask=mask,
                                    joint_key_mask=tmask)
                ok = tuple(out.shape) == tuple(ref.shape) and not out.isnan().any()
                rows.append((c["id"], name, ctx.strategy, max_abs_err(out, ref) if ok else math.inf,
                             ctx.stats()["inter_node_bytes"], ctx.mesh.describe(),
                             max_abs_err(out, wrong) if ok else math.inf))
            finally:
                ctx.close()
    return rows


# per topology: GQA with several rep values (Hkv % G == 0 and != 0), masks (random, whole
# chunks masked, fully masked rows, Krea-2 style), with and without joint text (and its mask)
MATRIX = {
    "2x2-U4xR1": ("2x2", [
        _case(0, 24, 8, U=4),                          # Lumina2: rep 3, 2 K/V heads per group
        _case(1, 12, 6, U=4, Tj=5),                    # 6 % 4 != 0: expanded to 12
        _case(2, 8, 1, U=4, mask="random"),            # MQA, expanded to 4
        _case(3, 8, 8, U=4, mask="chunks", Tj=3, where="rear"),
        _case(4, 8, 4, U=4, mask="rows", Tj=4, text_mask=True),
        _case(5, 8, 8, U=4, mask="krea", S=5),
    ]),
    "2x2-U2xR2": ("2x2", [
        _case(0, 12, 4, U=2),                          # rep 3, 2 K/V heads per group
        _case(1, 12, 3, U=2, mask="chunks", Tj=4),     # 3 % 2 != 0: expanded to 6
        _case(2, 6, 6, U=2, mask="rows", where="rear", Tj=3, text_mask=True),
        _case(3, 4, 2, U=2, mask="random", B=1),
    ]),
    "4x2": ("4x2", [
        _case(0, 24, 8, U=8, S=4),                     # Lumina2: 1 K/V head per group
        _case(1, 16, 4, U=8, S=4, mask="chunks", Tj=3),  # 4 % 8 != 0: expanded to 8
        _case(2, 8, 2, U=4, S=4, mask="rows", Tj=2, where="rear", text_mask=True),  # U4xR2
        _case(3, 8, 8, U=4, S=4, mask="random"),
    ]),
}


@pytest.mark.parametrize("name", sorted(MATRIX))
def test_strategies_gqa_and_masks(name):
    topo, cases = MATRIX[name]
    per_rank = run_emulated(_gqa_mask_rank, topo, cases, STRATS, timeout_s=600)
    failures = []
    for rank, rows in enumerate(per_rank):
        for cid, strat, ran_as, err, _, mesh, wrong in rows:
            c = cases[cid]
            if (c["Hkv"] < c["H"] or c["mask"]) and not wrong > 1e-2:
                failures.append(f"case {c}: the negative control is within {wrong:.1e}")
            if not err <= TOL:
                failures.append(f"rank {rank} case {cases[cid]} {strat} (ran as {ran_as} on "
                                f"{mesh}): err {err:.3e}")
            if strat != "auto" and ran_as != strat:
                failures.append(f"{strat} ran as {ran_as} on {mesh}")
    assert not failures, "\n".join(failures)
    assert len(per_rank[0]) == len(cases) * len(STRATS)


def test_gqa_moves_fewer_inter_node_bytes():
    """2x2, U4 (4 head groups): Q and O move with H heads, K/V with H_kv' = lcm(H_kv, 4):
    the inter-node bytes are (2 + 2 H_kv' / H) / 4 of MHA's (H = 24: Lumina2's 8 K/V heads
    move unexpanded, 2/3 of MHA; H = 8 with 2 K/V heads: expanded to 4, 3/4 of MHA)."""
    cases = [_case(0, 24, 24, U=4, B=1, S=4), _case(1, 24, 8, U=4, B=1, S=4),
             _case(2, 8, 8, U=4, B=1, S=4), _case(3, 8, 2, U=4, B=1, S=4)]
    strategies = ("tas", "torus", "swiftfusion")
    for rows in run_emulated(_gqa_mask_rank, "2x2", cases, strategies, timeout_s=300):
        by = {(cid, s): (err, inter) for cid, s, _, err, inter, *_ in rows}
        for s in strategies:
            for mha_id, gqa_id, ratio in ((0, 1, (2 + 2 * 8 / 24) / 4), (2, 3, (2 + 2 * 4 / 8) / 4)):
                (e_mha, mha), (e_gqa, gqa) = by[(mha_id, s)], by[(gqa_id, s)]
                assert e_mha <= TOL and e_gqa <= TOL
                assert gqa < mha and gqa == mha * ratio, (s, gqa, mha, ratio)


def _heap_rank(H, Hkv):
    rank, world = dist.get_rank(), dist.get_world_size()
    S, D = 4, 8
    ctx = sf.init_sequence_parallel("swiftfusion", H, timeout_s=60)
    try:
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, H, S, D, generator=g)
        k, v = (torch.randn(1, Hkv, S, D, generator=g) for _ in range(2))
        ctx.attention(q, k, v)
        return ctx.stats()["symmetric_heap_bytes"], ctx.mesh.torus
    finally:
        ctx.close()


def test_swiftfusion_heap_sized_for_kv_heads():
    """K/V buffers ``(1 + (T-1)/T) * 2`` slots of h_kv heads; Q/O slots of h heads."""
    (mha, T), *_ = run_emulated(_heap_rank, "2x2", 8, 8, timeout_s=120)
    (gqa, _), *_ = run_emulated(_heap_rank, "2x2", 8, 4, timeout_s=120)  # 4 groups: unexpanded
    X = 1 * 8 * 4 * 8 * 4  # one rank's Q, fp32
    assert T == 2 and mha - gqa == (2 + 2 * (T - 1) / T) * X * (1 - 4 / 8)


def _errors_rank():
    rank, world = dist.get_rank(), dist.get_world_size()
    ctx = sf.init_sequence_parallel("tas", 6, timeout_s=60)
    msgs = []
    try:
        q = torch.randn(1, 6, 4, 8)
        for kw in (dict(k=torch.randn(1, 4, 4, 8)),                       # 6 % 4
                   dict(kv_head_repeat=3),                                # 6 != 3 * 3
                   dict(key_mask=torch.ones(1, 4 * world)),                # not bool
                   dict(key_mask=torch.ones(1, 5, dtype=torch.bool))):     # wrong length
            k = kw.pop("k", torch.randn(1, 3, 4, 8))
            try:
                ctx.attention(q, k, k, **kw)
                msgs.append(None)
            except InputError as exc:
                msgs.append(str(exc))
    finally:
        ctx.close()
    return msgs


def test_bad_gqa_and_mask_inputs_name_the_constraint():
    msgs = run_emulated(_errors_rank, "1x2", timeout_s=60)[0]
    assert "H_kv dividing H" in msgs[0]
    assert "kv_head_repeat=3" in msgs[1]
    assert "bool" in msgs[2]
    assert "[B=1, L=8]" in msgs[3]


# --- Triton kernel (interpreter on CPU): K/V head h // rep read in place ------------------------

def _triton_case(H, Hkv, masked):
    def case():
        from xfuser_swiftfusion.kernels import current_backend

        assert current_backend(torch.device("cpu"), 32, torch.float32) == "triton"
        g = torch.Generator().manual_seed(H + Hkv)
        q, kv = _rand_chunks(g, 2, H, Hkv, 32, (5, 19), (7, 20))
        masks = [torch.rand(2, n, generator=g) > 0.3 for n in (7, 20)] if masked else None
        states = [new_state(x) for x in q]
        outs = attend(q, kv, states, scale=0.2, finalize=True, key_masks=masks)  # masked: on cpu
        K, V = (torch.cat([c[i] for c in kv], 2) for i in (0, 1))
        M = torch.cat(masks, 1) if masked else None
        for o, x in zip(outs, q):
            err = max_abs_err(o, attention(x, K, V, 0.2, M))
            assert err <= TOL, err
    return case


TRITON_CASES = {f"H{H}-Hkv{Hkv}{'-masked' if m else ''}": _triton_case(H, Hkv, m)
                for H, Hkv, m in ((6, 2, False), (4, 1, False), (4, 4, False), (6, 3, True))}


def test_triton_interpreter_gqa():
    pytest.importorskip("triton")
    from support.interpreter import run_cases_in_subprocess

    results = run_cases_in_subprocess(__file__)
    assert results == {name: "ok" for name in TRITON_CASES}, results


if __name__ == "__main__":
    from support.interpreter import report

    report(TRITON_CASES)
