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
                 "prepared-launch"]


# ------------------------------------------------------------------ subprocess side
def _interpreter_cases() -> dict:
    """Runs in the subprocess (TRITON_INTERPRET=1); one callable per case name."""
    from test_kernels import TOL, assert_matches, make_case, reference, run_in_calls

    from xfuser_swiftfusion.kernels import attend, new_state

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

    cases = {name: (lambda a=args: random_case(*a)) for name, *args in RANDOM_CASES}
    cases.update(
        {
            "many-q-chunks": many_q_chunks,
            "no-kv-finalize": no_kv_finalize,
            "large-scores": large_scores,
            "unaligned-input": unaligned_input,
            "unaligned-state-raises": unaligned_state_raises,
            "prepared-launch": prepared_launch,
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
