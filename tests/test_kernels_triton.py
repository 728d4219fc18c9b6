"""Triton backend of xfuser_swiftfusion.kernels.

* Numerics under the Triton interpreter: TRITON_INTERPRET must be set before triton is first
  imported, so the cases run in a subprocess (this file executed as a script) and report one
  line of JSON per case; each case is then one pytest test here.
* Ahead-of-time compilation of every shipped configuration for sm_80 and sm_90 (no GPU
  needed): shared memory within A100 / H100 limits, no register spills.
"""
from __future__ import annotations

import math
import os
import random

import pytest
import torch

from support.interpreter import report, run_cases_in_subprocess

HERE = os.path.dirname(os.path.abspath(__file__))
SHARED_LIMIT = {80: 164 * 1024, 90: 228 * 1024}  # bytes per block: A100, H100

# (name, dtype, B, H, D): random chunk layouts as in test_kernels.py, small enough for the
# interpreter (it runs every program instance in Python).
RANDOM_CASES = [
    (f"random-{dt}-D{D}-B{B}-H{H}", dt, B, H, D)
    for dt, (B, H), D in [
        ("float32", (1, 1), 32),
        ("float32", (2, 3), 64),
        ("float32", (1, 3), 128),
        ("bfloat16", (2, 3), 32),
        ("bfloat16", (1, 24), 64),
        ("bfloat16", (1, 1), 128),
        ("float16", (1, 3), 32),
        ("float16", (2, 1), 64),
        ("float16", (1, 3), 128),
    ]
]
SPECIAL_CASES = ["many-q-chunks", "no-kv-finalize", "large-scores", "unaligned-input", "unaligned-state-raises",
                 "prepared-launch", "split-kv", "split-kv-prepared-no-host-work", "combine-matches-torch-merge",
                 "combine-finalize-only", "combine-nan-propagates", "torch-backend-through-combine",
                 "torch-backend-key-masked-through-combine"]


# ------------------------------------------------------------------ subprocess side
def _random_state(B: int, H: int, L: int, D: int):
    """A running state part-way through: random acc, m, l, every third row still empty."""
    from xfuser_swiftfusion.kernels import AttnState

    acc, m, l = torch.randn(B, H, L, D), torch.randn(B, H, L) * 3, torch.rand(B, H, L) + 0.5
    m[..., ::3], l[..., ::3], acc[..., ::3, :] = float("-inf"), 0.0, 0.0
    return AttnState(acc, m, l)


def _interpreter_cases() -> dict:
    """Runs in the subprocess (TRITON_INTERPRET=1); one callable per case name."""
    from test_kernels import TOL, assert_matches, make_case, reference, run_in_calls

    from xfuser_swiftfusion.kernels import AttnState, attend, new_state

    def random_case(dtype_name, B, H, D):
        dtype = getattr(torch, dtype_name)
        rng = random.Random(f"{dtype_name}-{B}-{H}-{D}")
        torch.manual_seed(rng.randint(0, 2**31))
        for trial in range(2):
            q_chunks, kv_chunks = make_case(rng, dtype, B, H, D)
            outs, states = run_in_calls(q_chunks, kv_chunks, D**-0.5, rng, use_out=trial == 1)
            for q, o, s in zip(q_chunks, outs, states):
                assert o.dtype == dtype and o.shape == q.shape
                assert_matches(o, s.lse(), *reference(q, kv_chunks, D**-0.5), TOL[dtype])

    def many_q_chunks():  # cQO search across empty and multi-tile chunks, two calls
        torch.manual_seed(0)
        q_chunks = [torch.randn(1, 2, L, 32) for L in (33, 0, 1, 0, 70, 5)]
        kv = [(torch.randn(1, 2, L, 32), torch.randn(1, 2, L, 32)) for L in (40, 0, 3)]
        states = [new_state(q) for q in q_chunks]
        attend(q_chunks, kv[:1], states, scale=0.3)
        outs = attend(q_chunks, kv[1:], states, scale=0.3, finalize=True)
        for q, o, s in zip(q_chunks, outs, states):
            assert_matches(o, s.lse(), *reference(q, kv, 0.3), 1e-5)

    def no_kv_finalize():
        q = torch.randn(1, 2, 9, 64, dtype=torch.bfloat16)
        s = new_state(q)
        (o,) = attend([q], [], [s], scale=0.1, finalize=True)
        assert torch.equal(o, torch.zeros_like(q)) and torch.isneginf(s.lse()).all()

    def large_scores():
        torch.manual_seed(1)
        q = torch.randn(1, 2, 9, 64) * 12
        kv = [(torch.randn(1, 2, L, 64) * 12, torch.randn(1, 2, L, 64)) for L in (7, 40)]
        s = [new_state(q)]
        attend([q], kv[:1], s, scale=1.0)
        (o,) = attend([q], kv[1:], s, scale=1.0, finalize=True)
        ref_out, ref_lse = reference(q, kv, 1.0)
        assert ref_lse.abs().max() > 1e3
        assert_matches(o, s[0].lse(), ref_out, ref_lse, 1e-2, lse_rtol=1e-6)

    def unaligned_input():  # L stride 33: not kernel-ready, copied by the launcher
        torch.manual_seed(2)
        q = torch.randn(1, 2, 20, 33)[..., :32]
        k, v = torch.randn(1, 2, 17, 33)[..., 1:], torch.randn(1, 2, 17, 32)
        s = new_state(q)
        (o,) = attend([q], [(k, v)], [s], scale=0.2, finalize=True)
        assert_matches(o, s.lse(), *reference(q, [(k, v)], 0.2), 1e-5)

    def unaligned_state_raises():  # written in place, so it cannot be copied: must refuse
        q = torch.randn(1, 2, 4, 32)
        s = new_state(q)
        s.acc = torch.zeros(1, 2, 4, 33)[..., :32]
        try:
            attend([q], [(q, q)], [s], scale=1.0)
        except ValueError:
            return
        raise AssertionError("misaligned in-place state was accepted")

    def prepared_launch():  # prepare_triton: the table built once, each call the launch alone
        from xfuser_swiftfusion.kernels.triton_attend import prepare_triton

        torch.manual_seed(3)
        q_chunks = [torch.randn(1, 2, L, 64, dtype=torch.bfloat16) for L in (9, 0, 40)]
        kv = [(torch.randn(1, 2, L, 64, dtype=torch.bfloat16), torch.randn(1, 2, L, 64, dtype=torch.bfloat16))
              for L in (7, 30)]
        states = [new_state(q) for q in q_chunks]
        outs = [torch.full(q.shape, float("nan"), dtype=q.dtype) for q in q_chunks]
        launch = prepare_triton(q_chunks, kv, states, 0.125, out=outs)
        assert all(torch.isnan(o).all() for o in outs if o.numel())  # nothing ran yet
        launch()
        for q, o, s in zip(q_chunks, outs, states):
            assert_matches(o, s.lse(), *reference(q, kv, 0.125), TOL[torch.bfloat16])
        launch()  # the same keys merged again: the output stays, the LSE grows by log 2
        for q, o, s in zip(q_chunks, outs, states):
            ref_out, ref_lse = reference(q, kv, 0.125)
            assert_matches(o, s.lse() - math.log(2), ref_out, ref_lse, TOL[torch.bfloat16])

    def split_kv():  # every split count (more ranges than K/V tiles too), GQA, two calls
        from xfuser_swiftfusion.kernels.triton_attend import KernelConfig, attend_triton

        cfg = KernelConfig(32, 32, 1, 1)
        for dtype, n_split in ((torch.float32, 2), (torch.float32, 5), (torch.bfloat16, 3), (torch.float16, 9)):
            torch.manual_seed(n_split)
            q_chunks = [torch.randn(2, 4, L, 64, dtype=dtype) for L in (5, 0, 40)]
            kv = [tuple(torch.randn(2, 2, L, 64, dtype=dtype) for _ in range(2)) for L in (33, 0, 70, 1)]
            states = [new_state(q) for q in q_chunks]
            attend_triton(q_chunks, kv[:2], states, 0.125, cfg=cfg, n_split=n_split)
            outs = [torch.full(q.shape, float("nan"), dtype=dtype) for q in q_chunks]
            attend_triton(q_chunks, kv[2:], states, 0.125, out=outs, cfg=cfg, n_split=n_split)
            for q, o, s in zip(q_chunks, outs, states):
                assert_matches(o, s.lse(), *reference(q, kv, 0.125), TOL[dtype])

    def split_kv_prepared_no_host_work():
        """A prepared split launch: workspace and both tables made once; a call allocates and
        uploads nothing (what CUDA graph capture and cheap issue need)."""
        from xfuser_swiftfusion.kernels import graph_tables, triton_attend

        torch.manual_seed(5)
        q_chunks = [torch.randn(1, 2, L, 32) for L in (9, 40)]
        kv = [(torch.randn(1, 2, L, 32), torch.randn(1, 2, L, 32)) for L in (50, 30)]
        states = [new_state(q) for q in q_chunks]
        outs = [torch.empty_like(q) for q in q_chunks]
        launch = triton_attend.prepare_triton(q_chunks, kv, states, 0.2, out=outs,
                                              cfg=triton_attend.KernelConfig(32, 16, 1, 1), n_split=3)
        made = []
        real_empty, real_table = torch.empty, graph_tables.device_table
        torch.empty = lambda *a, **k: made.append("empty") or real_empty(*a, **k)
        triton_attend.device_table = lambda *a, **k: made.append("table") or real_table(*a, **k)
        try:
            launch()
            launch()  # the same keys merged again: the output stays, the LSE grows by log 2
        finally:
            torch.empty, triton_attend.device_table = real_empty, real_table
        assert made == [], made
        for q, o, s in zip(q_chunks, outs, states):
            ref_out, ref_lse = reference(q, kv, 0.2)
            assert_matches(o, s.lse() - math.log(2), ref_out, ref_lse, 1e-5)

    def combine_case(S, part_dtype, D, dead, finalize):
        """The combine kernel against the torch-op merge (state.merge_partial_ /
        merge_masked_ / finalize) on the same inputs."""
        from xfuser_swiftfusion.kernels.combine import CombinePlan
        from xfuser_swiftfusion.kernels.state import finalize as finalize_state, merge_masked_, merge_partial_

        B, H = 2, 3
        lengths = (5, 0, 40)
        states = [_random_state(B, H, L, D) for L in lengths]
        twins = [AttnState(s.acc.clone(), s.m.clone(), s.l.clone()) for s in states]
        parts = [torch.randn(S, B, L, H, D).to(part_dtype).transpose(2, 3) for L in lengths]  # [S, B, H, L, D] views
        lses = [torch.randn(S, B, H, L) * 3 for L in lengths]
        for x in lses:
            x[..., 1::4] = float("-inf")  # partial rows without keys
        outs = [torch.full((B, H, L, D), float("nan"), dtype=part_dtype) for L in lengths] if finalize else None
        CombinePlan(states, [p if S > 1 else p[0] for p in parts], [x if S > 1 else x[0] for x in lses],
                    outs, dead).launch()
        for i, t in enumerate(twins):
            for p, x in zip(parts[i], lses[i]):
                merge_partial_(t, p, x) if dead is None else merge_masked_(t, p, x, dead)
            if finalize:
                want = finalize_state(t, part_dtype)
                # the interpreter rounds fp32 -> bf16/fp16 toward zero (GPUs round to nearest)
                top = want.abs().max().item() if want.numel() else 0.0
                tol = 1e-5 if part_dtype == torch.float32 else 2 * torch.finfo(part_dtype).eps * top
                torch.testing.assert_close(outs[i].float(), want.float(), rtol=0, atol=tol)
        for s, t in zip(states, twins):
            assert torch.equal(s.m, t.m)
            torch.testing.assert_close(s.l, t.l, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(s.acc, t.acc, rtol=1e-5, atol=1e-5)

    def combine_matches_torch_merge():
        torch.manual_seed(6)
        dead = torch.tensor([False, True])
        for S, part_dtype, D, dead_, finalize in [(1, torch.float32, 64, None, False), (3, torch.float32, 72, None, True),
                                                  (1, torch.bfloat16, 128, dead, True), (2, torch.float16, 32, dead, False),
                                                  (4, torch.bfloat16, 96, None, True)]:
            combine_case(S, part_dtype, D, dead_, finalize)

    def combine_finalize_only():
        from xfuser_swiftfusion.kernels.combine import combine

        torch.manual_seed(7)
        states = [_random_state(1, 2, L, 64) for L in (7, 0, 33)]
        outs = [torch.full((1, 2, L, 64), float("nan")) for L in (7, 0, 33)]
        combine(states, None, None, outs)
        for s, o in zip(states, outs):
            want = s.acc / s.l.masked_fill(s.l == 0, 1.0).unsqueeze(-1)
            assert torch.equal(o, want) and not o.isnan().any()

    def combine_nan_propagates():  # a NaN partial row poisons its row only, as torch's merge does
        from xfuser_swiftfusion.kernels.combine import combine

        states = [_random_state(1, 2, 6, 32)]
        part, lse = torch.randn(1, 2, 6, 32), torch.randn(1, 2, 6)
        lse[0, 1, 2] = float("nan")
        combine(states, [part], [lse])
        bad = torch.zeros(1, 2, 6, dtype=torch.bool)
        bad[0, 1, 2] = True
        assert torch.equal(states[0].m.isnan(), bad) and torch.equal(states[0].acc.isnan().any(-1), bad)

    def torch_backend_through_combine():
        """attend_torch (the cuDNN / torch backends' merge) with the CPU op, merged by the
        combine kernel: joined Q, K/V split ranges, outputs written by the same launch."""
        from xfuser_swiftfusion.kernels import torch_cuda

        def op(q, k, v, scale):
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, scale=scale)[:2]

        torch.manual_seed(8)
        for dtype, splits in ((torch.float32, 1), (torch.float32, 4), (torch.bfloat16, 2)):
            q_chunks = [torch.randn(2, 4, L, 72, dtype=dtype) for L in (5, 0, 33)]
            kv = [tuple(torch.randn(2, 2, L, 72, dtype=dtype) for _ in range(2)) for L in (8, 0, 12, 20)]
            states = [new_state(q) for q in q_chunks]
            torch_cuda.attend_torch(q_chunks, kv[:2], states, 0.125, op=op, kv_splits=splits)
            outs = [torch.full(q.shape, float("nan"), dtype=dtype) for q in q_chunks]
            torch_cuda.attend_torch(q_chunks, kv[2:], states, 0.125, op=op, out=outs, kv_splits=splits)
            for q, o, s in zip(q_chunks, outs, states):
                assert_matches(o, s.lse(), *reference(q, kv, 0.125), TOL[dtype])
        # prepared once (joined buffers, split, combine table); each call merges the keys again
        q_chunks = [torch.randn(1, 2, L, 64) for L in (9, 4)]
        kv = [(torch.randn(1, 2, L, 64), torch.randn(1, 2, L, 64)) for L in (6, 10)]
        states = [new_state(q) for q in q_chunks]
        outs = [torch.empty_like(q) for q in q_chunks]
        run = torch_cuda.prepare_torch(q_chunks, kv, states, 0.2, op=op, out=outs, kv_splits=2)
        run()
        run()
        for q, o, s in zip(q_chunks, outs, states):
            ref_out, ref_lse = reference(q, kv, 0.2)
            assert_matches(o, s.lse() - math.log(2), ref_out, ref_lse, 1e-5)

    def torch_backend_key_masked_through_combine():
        """A key-masked call (the torch backend on CUDA): a batch entry with every key masked
        gains nothing, whatever the op returned for it."""
        from support.reference import attention_lse

        from xfuser_swiftfusion.kernels import torch_cuda

        torch.manual_seed(9)
        q = torch.randn(2, 2, 6, 32)
        kv = [(torch.randn(2, 2, L, 32), torch.randn(2, 2, L, 32)) for L in (5, 8)]
        masks = [torch.rand(2, L) > 0.3 for L in (5, 8)]
        masks[0][1] = masks[1][1] = False
        torch_cuda.masked_efficient_op = lambda q, k, v, scale, bias: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, attn_mask=bias, scale=scale)[:2]
        s = [new_state(q)]
        out = [torch.full_like(q, float("nan"))]
        torch_cuda.attend_torch([q], kv, s, 0.3, key_masks=masks, out=out)
        ref_out, ref_lse = attention_lse(q, torch.cat([k for k, _ in kv], 2), torch.cat([v for _, v in kv], 2), 0.3,
                                         torch.cat(masks, 1))
        assert_matches(out[0], s[0].lse(), ref_out, ref_lse, 1e-5)

    cases = {name: (lambda a=args: random_case(*a)) for name, *args in RANDOM_CASES}
    cases.update(
        {
            "many-q-chunks": many_q_chunks,
            "no-kv-finalize": no_kv_finalize,
            "large-scores": large_scores,
            "unaligned-input": unaligned_input,
            "unaligned-state-raises": unaligned_state_raises,
            "prepared-launch": prepared_launch,
            "split-kv": split_kv,
            "split-kv-prepared-no-host-work": split_kv_prepared_no_host_work,
            "combine-matches-torch-merge": combine_matches_torch_merge,
            "combine-finalize-only": combine_finalize_only,
            "combine-nan-propagates": combine_nan_propagates,
            "torch-backend-through-combine": torch_backend_through_combine,
            "torch-backend-key-masked-through-combine": torch_backend_key_masked_through_combine,
        }
    )
    return cases


# ------------------------------------------------------------------ pytest side
@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, str]:
    return run_cases_in_subprocess(__file__, timeout_s=600)


@pytest.mark.parametrize("case", [c[0] for c in RANDOM_CASES] + SPECIAL_CASES)
def test_interpreter(interpreter_results, case):
    assert "__subprocess__" not in interpreter_results, interpreter_results["__subprocess__"]
    assert interpreter_results.get(case) == "ok", interpreter_results.get(case, "case did not run")


# Every shipped configuration (head dim x arch) in both kernel variants; the dtype alternates
# (bf16 and fp16 compile to the same resource use). Cold triton cache: ~3-6 s per compile.
@pytest.mark.parametrize("dtype,finalize", [(torch.bfloat16, True), (torch.float16, False)])
@pytest.mark.parametrize("D", [32, 64, 128])
@pytest.mark.parametrize("arch", [80, 90])
def test_aot_compile_fits(arch, D, dtype, finalize):
    from xfuser_swiftfusion.kernels.triton_attend import aot_compile, resource_usage

    usage = resource_usage(aot_compile(D, dtype, arch, finalize=finalize))
    assert 0 < usage["shared"] <= SHARED_LIMIT[arch], usage
    assert usage["registers"] <= 255 and usage["stack"] == 0, f"register spills: {usage}"


def test_pick_config_falls_back_to_newest_known_arch():
    from xfuser_swiftfusion.kernels.triton_attend import CONFIGS, pick_config

    assert pick_config(128, 10) == CONFIGS[(128, 9)]
    assert pick_config(64, 7) == CONFIGS[(64, 8)]
    with pytest.raises(ValueError):
        pick_config(96, 8)


if __name__ == "__main__":
    report(_interpreter_cases())


# -- chunk tables under CUDA graph capture ---------------------------------------------------------

def test_captured_launches_copy_their_tables_from_pinned_slices_never_reused(monkeypatch):
    """A captured host-to-device copy is replayed from its source: inside capture each table
    comes from its own slice of the pinned arena (outside, from a temporary); the arena is
    pinned by the first launch outside capture and full is an error naming the setting."""
    from xfuser_swiftfusion.kernels import graph_tables as gt
    capturing, sources = [False], []
    monkeypatch.setattr(gt, "_arena", None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.setattr(gt, "_pin", lambda n: torch.full((n,), -1, dtype=torch.int64))
    monkeypatch.setattr(gt, "_upload", lambda t, device: sources.append(t) or t.clone())
    monkeypatch.setenv(gt.ENTRIES_ENV, "8")
    cuda = torch.device("cuda", 0)

    capturing[0] = True
    with pytest.raises(RuntimeError, match="warm-up"):
        gt.device_table([1, 2], cuda)
    capturing[0] = False
    assert gt.device_table([1, 2, 3], cuda).tolist() == [1, 2, 3]
    arena = gt._arena.memory
    assert arena.numel() == 8 and sources[-1].data_ptr() != arena.data_ptr() and gt._arena.used == 0

    capturing[0] = True
    a = gt.device_table([4, 5, 6], cuda)
    b = gt.device_table([7, 8, 9, 10], cuda)
    assert a.tolist() == [4, 5, 6] and b.tolist() == [7, 8, 9, 10]
    assert [s.data_ptr() for s in sources[-2:]] == [arena.data_ptr(), arena[3:].data_ptr()]
    assert arena.tolist() == [4, 5, 6, 7, 8, 9, 10, -1]  # slices kept as captured
    with pytest.raises(RuntimeError, match=f"{gt.ENTRIES_ENV}"):
        gt.device_table([11, 12], cuda)
    assert gt.device_table([0], torch.device("cpu")).tolist() == [0]  # the interpreter's tables
