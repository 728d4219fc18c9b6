"""Local attention kernels (xfuser_swiftfusion.kernels): CPU backend, flash-attn merge logic,
merge algebra and backend selection, all against an independent fp64 reference."""
from __future__ import annotations

import logging
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from xfuser_swiftfusion import kernels
from xfuser_swiftfusion.kernels import AttnState, attend, merge_states, new_state, select_backend, set_backend
from xfuser_swiftfusion.kernels import flash as flash_backend
from xfuser_swiftfusion.kernels.state import key_bias, repeat_kv
from support.reference import attention_lse

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2}


# ---------------------------------------------------------------- reference and comparison
def reference(q: torch.Tensor, kv_chunks, scale: float):
    """``support.reference.attention_lse`` of q ``[B, H, Lq, D]`` over the concatenation of all
    KV chunks: ``([B, H, Lq, D], [B, H, Lq])`` in fp64; rows without keys: (0, -inf)."""
    B, H, _, D = q.shape
    empty = q.new_empty(B, H, 0, D)
    k = torch.cat([k for k, _ in kv_chunks] or [empty], dim=2)  # [B, H, Lk, D]
    v = torch.cat([v for _, v in kv_chunks] or [empty], dim=2)  # [B, H, Lk, D]
    return attention_lse(q, k, v, scale)


def assert_matches(out, lse, ref_out, ref_lse, tol: float, lse_rtol: float = 0.0):
    """Output within ``tol`` (abs) of the reference; LSE within ``tol + lse_rtol * |LSE|``
    where finite and -inf exactly where the reference is -inf; no NaN anywhere."""
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "NaN in output or LSE"
    err = (out.double() - ref_out).abs().max().item() if out.numel() else 0.0
    assert err <= tol, f"output error {err:.3g} > {tol}"
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), "LSE finite where the reference is -inf (or vice versa)"
    excess = ((lse.double() - ref_lse).abs() - tol - lse_rtol * ref_lse.abs())[finite]
    assert not (excess > 0).any(), f"LSE error above {tol} + {lse_rtol} * |LSE|"


def make_case(rng: random.Random, dtype: torch.dtype, B: int, H: int, D: int):
    """Random Q chunks and KV chunks, some empty or tiny, some non-contiguous views."""
    lengths = [0, 1, 2, 3, 17, 64, 100]

    def tensor(L: int) -> torch.Tensor:
        kind = rng.choice(["contiguous", "blhd", "slice"])
        if kind == "blhd":  # a [B, L, H, D] buffer seen as [B, H, L, D]
            return torch.randn(B, L, H, D, dtype=dtype).transpose(1, 2)
        if kind == "slice":  # rows of a larger buffer
            return torch.randn(B, H, L + 5, D, dtype=dtype)[:, :, 3 : 3 + L]
        return torch.randn(B, H, L, D, dtype=dtype)

    q_chunks = [tensor(rng.choice(lengths)) for _ in range(rng.randint(1, 3))]
    kv_chunks = [(tensor(L), tensor(L)) for L in (rng.choice(lengths) for _ in range(rng.randint(0, 5)))]
    return q_chunks, kv_chunks


def run_in_calls(q_chunks, kv_chunks, scale: float, rng: random.Random, use_out: bool):
    """Feed the KV chunks over 1-3 attend calls, finalize on the last one."""
    states = [new_state(q) for q in q_chunks]
    n_calls = rng.randint(1, 3)
    cuts = sorted(rng.randint(0, len(kv_chunks)) for _ in range(n_calls - 1))
    groups = [kv_chunks[a:b] for a, b in zip([0, *cuts], [*cuts, len(kv_chunks)])]
    for g in groups[:-1]:
        assert attend(q_chunks, g, states, scale=scale) is None
    out = None
    if use_out:  # outputs into non-contiguous views of [B, L, H, D] buffers
        out = [torch.empty(q.shape[0], q.shape[2], q.shape[1], q.shape[3], dtype=q.dtype).transpose(1, 2) for q in q_chunks]
    outs = attend(q_chunks, groups[-1], states, scale=scale, finalize=True, out=out)
    if use_out:
        assert all(o is given for o, given in zip(outs, out))
    return outs, states


@pytest.fixture(autouse=True)
def _cpu_backend():
    set_backend("cpu")
    yield
    set_backend(None)


# ---------------------------------------------------------------- CPU backend vs reference
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [32, 64, 128])
@pytest.mark.parametrize("B,H", [(1, 1), (2, 3), (1, 24)])
def test_cpu_matches_reference(dtype, D, B, H):
    rng = random.Random(f"{dtype}-{D}-{B}-{H}")
    torch.manual_seed(rng.randint(0, 2**31))
    for trial in range(3):
        q_chunks, kv_chunks = make_case(rng, dtype, B, H, D)
        scale = D**-0.5
        outs, states = run_in_calls(q_chunks, kv_chunks, scale, rng, use_out=trial == 1)
        for q, o, s in zip(q_chunks, outs, states):
            assert o.dtype == dtype and o.shape == q.shape
            assert_matches(o, s.lse(), *reference(q, kv_chunks, scale), TOL[dtype])


@pytest.mark.parametrize("lengths,groups", [([512] * 4, [1024, 1024]), ([512] * 3, [1536]),
                                            ([100] * 10, [1000]), ([800, 1, 900], [800, 901]),
                                            ([2000], [2000]), ([384] * 4, [768, 768]),
                                            ([768, 768], [768, 768]), ([384, 383, 384, 384], [1535]),
                                            ([768, 384, 383, 384, 384], [768, 1535])])
def test_cpu_query_chunks_joined_into_big_tile_groups(lengths, groups):
    from xfuser_swiftfusion.kernels import cpu
    work = [(torch.empty(1, 1, n, 8), None) for n in lengths]
    assert [sum(q.shape[2] for q, _ in g) for g in cpu._groups(work)] == groups


def test_cpu_matches_reference_across_query_groups():
    torch.manual_seed(7)
    q_chunks = [torch.randn(1, 2, n, 32) for n in (400, 500, 300, 700)]  # groups 900 + 1000
    kv_chunks = [(torch.randn(1, 2, n, 32), torch.randn(1, 2, n, 32)) for n in (300, 200)]
    outs, states = run_in_calls(q_chunks, kv_chunks, 32**-0.5, random.Random(1), use_out=False)
    for q, o, s in zip(q_chunks, outs, states):
        assert_matches(o, s.lse(), *reference(q, kv_chunks, 32**-0.5), TOL[torch.float32])


def test_no_keys_gives_zero_output_and_minus_inf_lse():
    q = torch.randn(2, 3, 5, 32)
    s = new_state(q)
    (o,) = attend([q], [], [s], scale=0.1, finalize=True)
    assert torch.equal(o, torch.zeros_like(q))
    assert torch.isneginf(s.lse()).all()
    (o,) = attend([q], [(torch.randn(2, 3, 0, 32), torch.randn(2, 3, 0, 32))], [s], scale=0.1, finalize=True)
    assert torch.equal(o, torch.zeros_like(q))


@pytest.mark.parametrize("Lk", [1, 6, 12, 300])
def test_nan_query_row_gives_nan_row_only(Lk):
    """A query row holding a NaN: NaN in that row (softmax math), finite everywhere else; torch's
    CPU op alone returns NaN or 0 for it depending on Lk (0 at Lk = 6 on AVX2)."""
    torch.manual_seed(Lk)
    q, k, v = torch.randn(1, 2, 5, 16), torch.randn(1, 2, Lk, 16), torch.randn(1, 2, Lk, 16)
    q[0, 1, 3, 0] = float("nan")
    ref_out, _ = reference(q, [(k, v)], 0.25)
    (o,) = attend([q], [(k, v)], [new_state(q)], scale=0.25, finalize=True)
    assert torch.equal(o.isnan(), ref_out.isnan()) and o[0, 1, 3].isnan().all()


def test_large_scores_no_overflow():
    """|scores| ~ 1e4: finite, and (nearly one-hot) softmax still matches the reference."""
    torch.manual_seed(0)
    q = torch.randn(1, 2, 9, 64) * 12
    kv = [(torch.randn(1, 2, L, 64) * 12, torch.randn(1, 2, L, 64)) for L in (7, 1, 30)]
    states = [new_state(q)]
    attend([q], kv[:1], states, scale=1.0)
    (o,) = attend([q], kv[1:], states, scale=1.0, finalize=True)
    ref_out, ref_lse = reference(q, kv, 1.0)
    assert ref_lse.abs().max() > 1e3
    assert_matches(o, states[0].lse(), ref_out, ref_lse, 1e-2, lse_rtol=1e-6)


def test_finalize_keeps_state_usable():
    torch.manual_seed(1)
    q = torch.randn(1, 3, 8, 64)
    kv = [(torch.randn(1, 3, L, 64), torch.randn(1, 3, L, 64)) for L in (5, 9)]
    s = [new_state(q)]
    attend([q], kv[:1], s, scale=0.125, finalize=True)
    (o,) = attend([q], kv[1:], s, scale=0.125, finalize=True)
    assert_matches(o, s[0].lse(), *reference(q, kv, 0.125), 1e-5)


def test_one_element_query_chunk_is_attended():
    """A query chunk of one element (``[1, 1, 1, 1]``) has a row: it is attended, not skipped."""
    torch.manual_seed(2)
    q = torch.randn(1, 1, 1, 1)
    kv = [(torch.randn(1, 1, 4, 1), torch.randn(1, 1, 4, 1))]
    s = [new_state(q)]
    (o,) = attend([q], kv, s, scale=0.5, finalize=True)
    assert_matches(o, s[0].lse(), *reference(q, kv, 0.5), 1e-5)


@pytest.mark.parametrize("H,Hkv", [(4, 4), (4, 2), (6, 1)])
def test_repeat_kv_follows_the_head_mapping(H, Hkv):
    """``repeat_kv`` (the CUDA backends' GQA; torch's CPU op maps heads itself): query head i
    reads K/V head ``i // (H / H_kv)``."""
    x = torch.randn(2, Hkv, 3, 4)
    assert torch.equal(repeat_kv(x, H), x[:, torch.arange(H) // (H // Hkv)])


def test_key_masks_stay_with_their_chunks_of_one_key():
    """Key masks of K/V chunks of 0, 1 and 3 keys: each mask applies to its own chunk."""
    torch.manual_seed(3)
    q = torch.randn(2, 2, 5, 8)
    kv = [(torch.randn(2, 2, n, 8), torch.randn(2, 2, n, 8)) for n in (1, 0, 3)]
    masks = [torch.tensor([[False], [True]]), torch.ones(2, 0, dtype=torch.bool),
             torch.tensor([[True, False, True], [False, True, True]])]
    s = [new_state(q)]
    (o,) = attend([q], kv, s, scale=0.5, key_masks=masks, finalize=True)
    K, V = (torch.cat([c[i] for c in kv], 2) for i in (0, 1))
    ref, lse = attention_lse(q, K, V, 0.5, torch.cat(masks, 1))
    assert_matches(o, s[0].lse(), ref, lse, 1e-5)


def test_key_bias_values_and_aligned_storage():
    """``key_bias``: 0 where the mask is True, -inf where False, ``[B, 1, 1, Lk]`` viewing a
    storage of ``ceil(Lk / align) * align`` columns per batch entry."""
    mask = torch.tensor([[True, False, True, True, False], [False, True, True, False, True]])
    want = torch.zeros(2, 5).masked_fill(~mask, float("-inf"))[:, None, None, :]
    for align, cols in ((1, 5), (4, 8), (8, 8)):
        bias = key_bias(mask, torch.float32, align)
        assert torch.equal(bias, want) and bias.stride(0) == cols, (align, bias.stride())


def test_shape_and_dtype_errors():
    q = torch.randn(1, 2, 4, 32)
    k = torch.randn(1, 3, 4, 32)
    with pytest.raises(ValueError):
        attend([q], [(k, k)], [new_state(q)], scale=1.0)
    with pytest.raises(ValueError):
        attend([q], [], [], scale=1.0)
    kb = torch.randn(1, 2, 4, 32, dtype=torch.bfloat16)
    with pytest.raises(TypeError):
        attend([q], [(kb, kb)], [new_state(q)], scale=1.0)
    with pytest.raises(TypeError):  # states are fp32, whatever the input dtype
        s = new_state(kb)
        attend([kb], [(kb, kb)], [AttnState(s.acc.bfloat16(), s.m, s.l)], scale=1.0)
    with pytest.raises(ValueError):
        attend([q], [(q, q)], [new_state(q)], scale=1.0, finalize=True, out=[torch.empty(1, 2, 5, 32)])


# ---------------------------------------------------------------- the comparison can fail
def _merge_without_rescale(state: AttnState, out: torch.Tensor, lse: torch.Tensor) -> None:
    """A deliberately wrong merge: forgets to rescale the old accumulator."""
    m = torch.maximum(state.m, lse)
    f = torch.exp(lse - m)
    state.acc.addcmul_(out, f.unsqueeze(-1))
    state.l.add_(f)
    state.m.copy_(m)


def test_comparison_detects_wrong_merge(monkeypatch):
    from xfuser_swiftfusion.kernels import cpu

    monkeypatch.setattr(cpu, "merge_partial_", _merge_without_rescale)
    torch.manual_seed(2)
    q = torch.randn(1, 2, 16, 64)
    kv = [(torch.randn(1, 2, 16, 64), torch.randn(1, 2, 16, 64)) for _ in range(3)]
    s = [new_state(q)]
    for pair in kv[:-1]:
        attend([q], [pair], s, scale=1.0)
    (o,) = attend([q], kv[-1:], s, scale=1.0, finalize=True)
    with pytest.raises(AssertionError):
        assert_matches(o, s[0].lse(), *reference(q, kv, 1.0), 1e-5)


# ---------------------------------------------------------------- flash-attn merge logic
def _fake_flash_attn_func(q, k, v, softmax_scale, return_attn_probs):
    """flash_attn_func's contract, computed in fp64: [B, L, H, D] in, (out [B, L, H, D] in
    q's dtype, lse [B, H, L] fp32, probs) out."""
    assert return_attn_probs and q.shape[-1] == k.shape[-1]
    out, lse = reference(q.transpose(1, 2), [(k.transpose(1, 2), v.transpose(1, 2))], softmax_scale)
    return out.transpose(1, 2).to(q.dtype), lse.float(), None  # [B, H, L, D] -> [B, L, H, D]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flash_backend_merge_and_layout(monkeypatch, dtype):
    monkeypatch.setattr(flash_backend, "_flash_attn_func", lambda: _fake_flash_attn_func)
    rng = random.Random(3)
    torch.manual_seed(3)
    for _ in range(4):
        q_chunks, kv_chunks = make_case(rng, dtype, 2, 3, 64)
        states = [new_state(q) for q in q_chunks]
        flash_backend.attend_flash(q_chunks, kv_chunks[:2], states, 0.125)
        flash_backend.attend_flash(q_chunks, kv_chunks[2:], states, 0.125)
        for q, s in zip(q_chunks, states):
            out = s.acc / s.l.clamp_min(1e-30).unsqueeze(-1)
            assert_matches(out, s.lse(), *reference(q, kv_chunks, 0.125), TOL[dtype])


def test_flash_backend_gqa_passes_kv_heads_unrepeated(monkeypatch):
    """flash-attn takes K/V with fewer heads itself: the backend passes them as they are
    ([B, L, H_kv, D]); query head i reads K/V head i // (H / H_kv) (the fake: the reference)."""
    seen = []

    def fake(q, k, v, **kw):
        seen.append((q.shape[2], k.shape[2]))
        return _fake_flash_attn_func(q, k, v, **kw)

    monkeypatch.setattr(flash_backend, "_flash_attn_func", lambda: fake)
    g = torch.Generator().manual_seed(4)
    q_chunks = [torch.randn(2, 6, n, 32, generator=g).bfloat16() for n in (5, 9)]
    kv_chunks = [tuple(torch.randn(2, 2, n, 32, generator=g).bfloat16() for _ in range(2)) for n in (4, 7)]
    states = [new_state(q) for q in q_chunks]
    flash_backend.attend_flash(q_chunks, kv_chunks, states, 0.2)
    assert seen == [(6, 2)]  # one call over both Q chunks
    for q, s in zip(q_chunks, states):
        assert_matches(s.acc / s.l.unsqueeze(-1), s.lse(), *reference(q, kv_chunks, 0.2), TOL[torch.bfloat16])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["triton", "flash", "torch"])
def test_cuda_backends_gqa_and_key_masks(backend):
    """On a GPU: GQA on every backend; key masks (run on torch's memory-efficient attention
    with a bias, whatever the backend) including a fully masked batch entry."""
    try:
        set_backend(backend)
        kernels.current_backend(torch.device("cuda"), 64, torch.bfloat16)
    except RuntimeError as exc:
        set_backend(None)
        pytest.skip(str(exc))
    try:
        g = torch.Generator().manual_seed(6)
        q_chunks = [torch.randn(2, 8, n, 64, generator=g).bfloat16().cuda() for n in (70, 5)]
        kv_chunks = [tuple(torch.randn(2, 2, n, 64, generator=g).bfloat16().cuda() for _ in range(2))
                     for n in (33, 50)]
        masks = [torch.rand(2, n, generator=g).cuda() > 0.3 for n in (33, 50)]
        masks[0][1] = masks[1][1] = False
        for key_masks in (None, masks):
            states = [new_state(q) for q in q_chunks]
            outs = attend(q_chunks, kv_chunks, states, scale=0.125, finalize=True, key_masks=key_masks)
            K, V = (torch.cat([c[i] for c in kv_chunks], 2).cpu() for i in (0, 1))
            M = None if key_masks is None else torch.cat(masks, 1).cpu()
            for q, o in zip(q_chunks, outs):
                ref, _ = attention_lse(q.cpu(), K, V, 0.125, M)
                assert (o.cpu().double() - ref).abs().max() <= 2e-2
            if key_masks is not None:
                assert all(o[1].abs().max() == 0 for o in outs)  # no unmasked key: 0
    finally:
        set_backend(None)


# ---------------------------------------------------------------- merge algebra (hypothesis)
def _chunk_state(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> AttnState:
    """Exact fp64 state of q against one key chunk, stored as fp32 (empty chunk: new_state)."""
    if k.shape[2] == 0:
        return new_state(q)
    s = q.double() @ k.double().transpose(-1, -2)  # [B, H, Lq, Lk]
    m = s.amax(-1)
    p = torch.exp(s - m.unsqueeze(-1))
    return AttnState(acc=(p @ v.double()).float(), m=m.float(), l=p.sum(-1).float())


def _output(s: AttnState) -> torch.Tensor:
    return s.acc / s.l.masked_fill(s.l == 0, 1).unsqueeze(-1)


def _states(seed: int, magnitude: float, lengths: list[int]):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 2, 6, 8, generator=g, dtype=torch.float64) * magnitude**0.5
    kv = [
        (torch.randn(1, 2, L, 8, generator=g, dtype=torch.float64) * magnitude**0.5, torch.randn(1, 2, L, 8, generator=g))
        for L in lengths
    ]
    return q, kv, [_chunk_state(q, k, v) for k, v in kv]


_magnitudes = st.sampled_from([1.0, 30.0, 1e4])  # |scores| up to ~1e4 * sqrt(D)
_lengths = st.lists(st.sampled_from([0, 1, 3, 7]), min_size=3, max_size=3)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), magnitude=_magnitudes, lengths=_lengths)
def test_merge_commutative_and_associative(seed, magnitude, lengths):
    _, _, (a, b, c) = _states(seed, magnitude, lengths)
    ab, ba = merge_states(a, b), merge_states(b, a)
    for x, y in ((ab.acc, ba.acc), (ab.m, ba.m), (ab.l, ba.l)):
        assert torch.equal(x, y)
    left, right = merge_states(ab, c), merge_states(a, merge_states(b, c))
    for s in (left, right):
        assert not any(torch.isnan(t).any() for t in (s.acc, s.m, s.l))
    torch.testing.assert_close(_output(left), _output(right), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(left.lse(), right.lse(), rtol=1e-6, atol=1e-5)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), magnitude=_magnitudes, lengths=_lengths)
def test_merge_equals_attention_over_union(seed, magnitude, lengths):
    q, kv, (a, b, c) = _states(seed, magnitude, lengths)
    merged = merge_states(merge_states(a, b), c)
    ref_out, ref_lse = reference(q, kv, 1.0)
    tol = 1e-5 if magnitude < 1e3 else 1e-3  # scores ~ 1e4 are rounded to fp32 in the state
    assert_matches(_output(merged), merged.lse(), ref_out, ref_lse, tol, lse_rtol=1e-6)


def test_merge_with_empty_state_is_identity_and_nan_free():
    _, _, (a,) = _states(5, 1.0, [4])
    empty = new_state(torch.zeros(1, 2, 6, 8))
    for s in (merge_states(a, empty), merge_states(empty, a)):
        assert torch.equal(s.acc, a.acc) and torch.equal(s.m, a.m) and torch.equal(s.l, a.l)
    both = merge_states(empty, empty)
    assert torch.isneginf(both.m).all() and (both.l == 0).all() and (both.acc == 0).all()
    partially_masked = AttnState(a.acc.clone(), a.m.clone(), a.l.clone())
    partially_masked.m[..., ::2] = float("-inf")
    partially_masked.l[..., ::2] = 0
    partially_masked.acc[..., ::2, :] = 0
    s = merge_states(partially_masked, empty)
    assert not torch.isnan(s.acc).any() and torch.isneginf(s.lse()[..., ::2]).all()


# ---------------------------------------------------------------- backend selection
def test_select_backend(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv("SWIFTFUSION_KERNEL", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert select_backend(cpu) == "cpu"
    with pytest.raises(ValueError, match="unknown kernel backend"):
        select_backend(cpu, "cuda-magic")
    with pytest.raises(RuntimeError, match="CUDA"):
        select_backend(cpu, "flash")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        select_backend(cpu, "triton")
    monkeypatch.setenv("SWIFTFUSION_KERNEL", "flash")
    with pytest.raises(RuntimeError, match="flash"):
        select_backend(cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert select_backend(cpu, "triton") == "triton"


def test_backend_choice_logged_once(caplog):
    set_backend(None)
    q = torch.randn(1, 1, 2, 32)
    with caplog.at_level(logging.INFO, logger="xfuser.swiftfusion.kernels"):
        for _ in range(3):
            attend([q], [(q, q)], [new_state(q)], scale=1.0)
    assert kernels.current_backend(q.device) == "cpu"
    assert sum("backend" in r.getMessage() for r in caplog.records) == 1
    with pytest.raises(ValueError):
        set_backend("nope")


def test_auto_backend_prefers_default_and_falls_back(monkeypatch):
    from xfuser_swiftfusion.kernels import dispatch
    monkeypatch.delenv("SWIFTFUSION_KERNEL", raising=False)
    assert dispatch.select_backend(torch.device("cpu"), "auto") == "cpu"
    # a CUDA device without triton: flash-attn is the next choice; with neither, a clear error
    monkeypatch.setattr(dispatch, "_missing",
                        lambda n, d: {"triton": "the triton package", "flash": None}.get(n, "x"))
    assert dispatch.select_backend(torch.device("cuda"), "auto") == "flash"
    monkeypatch.setattr(dispatch, "_missing", lambda n, d: f"{n}-deps")
    with pytest.raises(RuntimeError, match="triton needs triton-deps; flash needs flash-deps"):
        dispatch.select_backend(torch.device("cuda"), "auto")
