"""Per-call kernel choice, the torch and flash-attn backends' merge logic, and the Triton
launch-configuration table.

* Selection: every (device type, head dim, dtype, flash-attn installed or not, triton
  installed or not, GPU arch) against an independent statement of what each backend supports;
  explicit requests that cannot run a shape fail naming the constraint.
* torch and cudnn backends: their merge runs with the CPU op on CPU tensors (the op is a
  parameter; cuDNN's is replaced by the CPU op in cuDNN's output layout) and is compared with
  the fp64 softmax reference; the real ops' argument binding and output shapes are checked on
  meta tensors (torch's meta kernels, the same in torch 2.11 and 2.13).
* The measured choice table: a fake table (env ``SWIFTFUSION_KERNEL_TABLE``) orders the
  automatic choice for its architecture and shapes; without a table or an entry, the default
  rule holds.
* flash backend: one flash_attn_func call on the joined Q chunks and the joined K/V.
* Triton table: ``pick_config``'s small-grid rule; every entry AOT-compiled for every GPU it
  serves (shared memory fits, no register spills); every entry's tile shape run under the
  Triton interpreter (subprocess: TRITON_INTERPRET must be set before triton is imported)
  and compared with the fp64 reference.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import random

import pytest
import torch

from support.interpreter import report, run_cases_in_subprocess
from support.reference import attention_lse
from xfuser_swiftfusion.kernels import choice, dispatch, new_state, set_backend
from xfuser_swiftfusion.kernels import flash as flash_backend
from xfuser_swiftfusion.kernels import interpret, torch_cuda

HERE = os.path.dirname(os.path.abspath(__file__))
HEAD_DIMS = (32, 64, 72, 88, 96, 128, 256)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
CUDA = torch.device("cuda")
CPU = torch.device("cpu")
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2}


@pytest.fixture(autouse=True)
def _automatic_choice(monkeypatch):
    monkeypatch.delenv("SWIFTFUSION_KERNEL", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv(choice.TABLE_ENV, raising=False)
    monkeypatch.setattr(choice, "PACKAGED", choice.PACKAGED.with_name("no-such-table.json"))
    set_backend(None)
    yield
    set_backend(None)
    choice.clear_cache()


def _packages(monkeypatch, *, flash: bool, triton: bool = True, cudnn: bool = True) -> None:
    """What is installed: flash-attn, triton, and whether torch has cuDNN (a CUDA build)."""
    installed = {"flash_attn": flash, "triton": triton}
    monkeypatch.setattr(dispatch, "_installed", lambda package: installed[package])
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: cudnn)


def reference(q, kv_chunks, scale):
    """fp64 attention of q [B, H, Lq, D] over all KV chunks: ([B, H, Lq, D], [B, H, Lq])."""
    B, H, _, D = q.shape
    empty = q.new_empty(B, H, 0, D)
    k = torch.cat([k for k, _ in kv_chunks] or [empty], dim=2)
    v = torch.cat([v for _, v in kv_chunks] or [empty], dim=2)
    return attention_lse(q, k, v, scale)


def assert_state_matches(state, q, kv_chunks, scale, tol):
    """The state's output acc / l and LSE within ``tol`` of the fp64 reference."""
    ref_out, ref_lse = reference(q, kv_chunks, scale)
    out = state.acc / state.l.masked_fill(state.l == 0, 1.0).unsqueeze(-1)
    assert not out.isnan().any()
    err = (out.double() - ref_out).abs().max().item() if out.numel() else 0.0
    assert err <= tol, f"output error {err:.3g} > {tol}"
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(state.lse()), finite)
    lse_err = (state.lse().double() - ref_lse)[finite].abs().max().item() if finite.any() else 0.0
    assert lse_err <= tol, f"LSE error {lse_err:.3g} > {tol}"


# ------------------------------------------------------------------ selection
def expected_backend(device_type, head_dim, dtype, flash, triton, capability):
    """What each backend supports, stated independently of dispatch.py."""
    if device_type == "cpu":
        return "cpu"
    half = dtype in (torch.float16, torch.bfloat16)
    if triton and head_dim in (32, 64, 128) and half and capability >= (8, 0):
        return "triton"
    if flash and half and head_dim % 8 == 0 and head_dim <= 256 and capability >= (8, 0):
        return "flash"
    return "torch"


@pytest.mark.parametrize("capability", [(8, 0), (9, 0), (7, 5)])
@pytest.mark.parametrize("triton", [True, False])
@pytest.mark.parametrize("flash", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_auto_choice_on_cuda(monkeypatch, head_dim, dtype, flash, triton, capability):
    _packages(monkeypatch, flash=flash, triton=triton)
    want = expected_backend("cuda", head_dim, dtype, flash, triton, capability)
    if dtype == torch.bfloat16 and capability < (8, 0):  # nothing runs bf16 before sm_80
        with pytest.raises(RuntimeError, match="torch needs sm_80 or newer for bf16"):
            dispatch.select_backend(CUDA, None, head_dim, dtype, capability)
        return
    assert dispatch.select_backend(CUDA, None, head_dim, dtype, capability) == want


@pytest.mark.parametrize("flash", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_auto_choice_on_cpu(monkeypatch, head_dim, dtype, flash):
    _packages(monkeypatch, flash=flash)
    assert dispatch.select_backend(CPU, None, head_dim, dtype) == "cpu"


@pytest.mark.parametrize("name,head_dim,dtype,capability,message", [
    ("triton", 72, torch.bfloat16, (8, 0), r"kernel backend 'triton' needs head dim in \(32, 64, 128\) \(got 72\)"),
    ("triton", 88, torch.float16, (9, 0), r"kernel backend 'triton' needs head dim in \(32, 64, 128\) \(got 88\)"),
    ("triton", 128, torch.float32, (9, 0), r"kernel backend 'triton' needs fp16/bf16 inputs.*float32"),
    ("triton", 64, torch.float16, (7, 5), r"kernel backend 'triton' needs sm_80 or newer \(got sm_75\)"),
    ("flash", 128, torch.float32, (8, 0), r"kernel backend 'flash' needs fp16/bf16 inputs"),
    ("flash", 260, torch.bfloat16, (8, 0), r"kernel backend 'flash' needs a head dim <= 256 and a multiple of 8"),
    ("flash", 36, torch.bfloat16, (8, 0), r"kernel backend 'flash' needs a head dim <= 256 and a multiple of 8"),
    ("cudnn", 128, torch.float32, (9, 0), r"kernel backend 'cudnn' needs fp16/bf16 inputs"),
    ("cudnn", 256, torch.bfloat16, (9, 0), r"kernel backend 'cudnn' needs a head dim <= 128 and a multiple of 8"),
    ("cudnn", 36, torch.float16, (9, 0), r"kernel backend 'cudnn' needs a head dim <= 128 and a multiple of 8"),
    ("cudnn", 64, torch.float16, (7, 5), r"kernel backend 'cudnn' needs sm_80 to sm_121 \(got sm_75\)"),
])  # fmt: skip
def test_explicit_request_that_cannot_run_the_shape_names_the_constraint(monkeypatch, name, head_dim, dtype,
                                                                         capability, message):
    _packages(monkeypatch, flash=True)
    with pytest.raises(RuntimeError, match=message):
        dispatch.select_backend(CUDA, name, head_dim, dtype, capability)
    monkeypatch.setenv("SWIFTFUSION_KERNEL", name)
    with pytest.raises(RuntimeError, match=message):
        dispatch.select_backend(CUDA, None, head_dim, dtype, capability)


def test_explicit_request_that_can_run_is_honoured(monkeypatch):
    _packages(monkeypatch, flash=True)
    assert dispatch.select_backend(CUDA, "torch", 128, torch.bfloat16, (9, 0)) == "torch"
    assert dispatch.select_backend(CUDA, "flash", 64, torch.bfloat16, (9, 0)) == "flash"
    assert dispatch.select_backend(CUDA, "triton", 128, torch.float16, (8, 0)) == "triton"
    assert dispatch.select_backend(CUDA, "cudnn", 72, torch.bfloat16, (9, 0)) == "cudnn"
    with pytest.raises(RuntimeError, match="kernel backend 'torch' needs a CUDA device"):
        dispatch.select_backend(CPU, "torch", 64, torch.float32)
    with pytest.raises(RuntimeError, match="kernel backend 'cudnn' needs a CUDA device"):
        dispatch.select_backend(CPU, "cudnn", 64, torch.bfloat16)
    _packages(monkeypatch, flash=True, cudnn=False)
    with pytest.raises(RuntimeError, match=r"kernel backend 'cudnn' needs torch built with cuDNN"):
        dispatch.select_backend(CUDA, "cudnn", 64, torch.bfloat16, (9, 0))
    with pytest.raises(RuntimeError, match="kernel backend 'flash' needs the flash_attn package"):
        _packages(monkeypatch, flash=False)
        dispatch.select_backend(CUDA, "flash", 64, torch.bfloat16, (9, 0))


def test_choice_is_per_shape_cached_and_logged_once_per_shape(monkeypatch, caplog):
    _packages(monkeypatch, flash=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    shapes = [(128, torch.bfloat16), (72, torch.bfloat16), (128, torch.float32), (128, torch.bfloat16)]
    with caplog.at_level(logging.INFO, logger="xfuser.swiftfusion.kernels"):
        got = [dispatch.current_backend(CUDA, d, dt) for d, dt in shapes for _ in range(2)]
    assert got == ["triton"] * 2 + ["torch"] * 4 + ["triton"] * 2
    logged = [r.getMessage() for r in caplog.records if "kernel backend for" in r.getMessage()]
    assert len(logged) == 3, logged
    assert "head dim 72, bfloat16: torch; triton needs head dim in (32, 64, 128)" in logged[1]
    assert "flash needs the flash_attn package" in logged[1]


def test_attend_routes_each_call_by_its_shape(monkeypatch):
    """CPU tensors stand in for CUDA ones: dispatch is told the device is CUDA and each
    backend is replaced by a recorder."""
    _packages(monkeypatch, flash=True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    calls = []
    monkeypatch.setattr(dispatch, "current_backend",
                        lambda device, d, dt: dispatch.select_backend(CUDA, None, d, dt))  # fmt: skip
    monkeypatch.setattr(flash_backend, "attend_flash",
                        lambda q, kv, s, scale, **kw: calls.append(("flash", q[0].shape[-1])))
    monkeypatch.setattr(torch_cuda, "attend_torch",
                        lambda q, kv, s, scale, **kw: calls.append(("torch", q[0].shape[-1])))
    import xfuser_swiftfusion.kernels.triton_attend as triton_attend

    monkeypatch.setattr(triton_attend, "prepare_triton",
                        lambda q, kv, s, scale, out, cfg=None: lambda: calls.append(("triton", q[0].shape[-1])))  # fmt: skip
    for D, dtype in [(64, torch.bfloat16), (72, torch.bfloat16), (96, torch.float32), (128, torch.float16)]:
        q = torch.zeros(1, 2, 3, D, dtype=dtype)
        dispatch.attend([q], [(q, q)], [new_state(q)], scale=0.1)
    assert calls == [("triton", 64), ("flash", 72), ("torch", 96), ("triton", 128)]


def test_attend_calls_counts_calls_with_queries():
    from xfuser_swiftfusion.kernels import attend, attend_calls

    set_backend("cpu")
    q = torch.randn(1, 2, 3, 32)
    before = attend_calls()
    attend([q], [(q, q)], [new_state(q)], scale=0.1)
    attend([q], [], [new_state(q)], scale=0.1, finalize=True)
    attend([], [(q, q)], [], scale=0.1)  # no queries: nothing to do, not counted
    assert attend_calls() - before == 2


# ------------------------------------------------------------------ torch backend (merge)
def _cpu_op(pad_lse: int = 32, pad_front: bool = False):
    """torch's CPU attention op in the shape contract of the CUDA ops: out [B, H, Lq, D], LSE
    fp32 [B, H, ceil(Lq / pad_lse) * pad_lse] whose tail is garbage (as the efficient op's);
    ``pad_front`` puts the garbage first (a broken op, for the negative control)."""
    calls = []

    def op(q, k, v, scale):
        calls.append((q.shape[2], k.shape[2], k.is_contiguous() or k.stride(-1) == 1))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, scale=scale)[:2]
        Lq = q.shape[2]
        pad = -(-Lq // pad_lse) * pad_lse - Lq
        junk = torch.full(lse.shape[:2] + (pad,), 1e4)
        lse = torch.cat([junk, lse] if pad_front else [lse, junk], dim=2)
        return out, lse

    op.calls = calls
    return op


def _chunks(rng, dtype, B, H, D, lengths):
    def tensor(L):
        kind = rng.choice(["contiguous", "blhd", "slice"])
        if kind == "blhd":  # a [B, L, H, D] buffer seen as [B, H, L, D]
            return torch.randn(B, L, H, D, dtype=dtype).transpose(1, 2)
        if kind == "slice":
            return torch.randn(B, H, L + 5, D, dtype=dtype)[:, :, 3 : 3 + L]
        return torch.randn(B, H, L, D, dtype=dtype)

    return [tensor(L) for L in lengths]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [72, 88, 96, 256])
def test_torch_backend_merge_matches_reference(dtype, D):
    rng = random.Random(f"torch-{D}-{dtype}")
    torch.manual_seed(rng.randint(0, 2**31))
    B, H, scale = 2, 3, D**-0.5
    q_chunks = _chunks(rng, dtype, B, H, D, [5, 0, 33, 70])
    ks = _chunks(rng, dtype, B, H, D, [7, 0, 40, 1])
    vs = _chunks(rng, dtype, B, H, D, [7, 0, 40, 1])
    kv_chunks = list(zip(ks, vs))
    states = [new_state(q) for q in q_chunks]
    op = _cpu_op()
    torch_cuda.attend_torch(q_chunks, kv_chunks[:2], states, scale, op=op)
    torch_cuda.attend_torch(q_chunks, kv_chunks[2:], states, scale, op=op)
    # one op call per attend_torch call: every non-empty Q chunk joined, against all its keys
    assert [c[:2] for c in op.calls] == [(108, 7), (108, 41)]
    for q, s in zip(q_chunks, states):
        assert_state_matches(s, q, kv_chunks, scale, TOL[dtype])


def test_torch_backend_comparison_detects_a_misread_lse():
    torch.manual_seed(4)
    q = torch.randn(1, 2, 20, 72)
    kv = [(torch.randn(1, 2, 9, 72), torch.randn(1, 2, 9, 72)) for _ in range(2)]
    s = [new_state(q)]
    for pair in kv:
        torch_cuda.attend_torch([q], [pair], s, 0.2, op=_cpu_op(pad_front=True))
    with pytest.raises(AssertionError):
        assert_state_matches(s[0], q, kv, 0.2, 1e-5)


def test_torch_cuda_op_choice():
    ok = torch_cuda.flash_op_supports
    assert ok(72, torch.bfloat16, (8, 0), True) and ok(256, torch.float16, (9, 0), True)
    assert not ok(72, torch.float32, (9, 0), True)  # fp32: efficient attention
    assert not ok(36, torch.bfloat16, (9, 0), True)  # not a multiple of 8
    assert not ok(264, torch.bfloat16, (9, 0), True)
    assert not ok(64, torch.float16, (7, 5), True)
    assert not ok(64, torch.float16, (9, 0), False)  # torch built without FlashAttention


def test_torch_ops_accept_the_call_on_meta_tensors():
    """The CUDA ops' argument binding and output shapes (meta kernels, no GPU needed)."""
    q = torch.empty(2, 3, 45, 72, device="meta", dtype=torch.bfloat16)
    k = torch.empty(2, 3, 100, 72, device="meta", dtype=torch.bfloat16)
    for op, lse_len in ((torch_cuda.efficient_op, 64), (torch_cuda.flash_op, 45)):
        out, lse = op(q, k, k, 0.1)
        assert out.shape == q.shape and lse.shape == (2, 3, lse_len) and lse.dtype == torch.float32


# ------------------------------------------------------------------ cudnn backend
def _cpu_cudnn_sdpa(calls):
    """``_scaled_dot_product_cudnn_attention`` on CPU tensors: torch's CPU op in cuDNN's output
    contract (9 results; LSE fp32 ``[B, H, Lq, 1]``), recording its arguments."""
    def op(q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False,
           return_debug_mask=False, *, scale=None):
        assert attn_bias is None and compute_log_sumexp and dropout_p == 0.0 and not is_causal
        assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
        calls.append((q.shape[2], k.shape[2], scale))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, scale=scale)[:2]
        return out, lse.unsqueeze(-1), None, None, q.shape[2], k.shape[2], None, None, None

    return op


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 72, 128])
def test_cudnn_backend_merge_matches_reference(monkeypatch, dtype, D):
    calls = []
    monkeypatch.setattr(torch_cuda, "_cudnn_sdpa", _cpu_cudnn_sdpa(calls))
    rng = random.Random(f"cudnn-{D}-{dtype}")
    torch.manual_seed(rng.randint(0, 2**31))
    B, H, scale = 2, 4, D**-0.5
    q_chunks = _chunks(rng, dtype, B, H, D, [5, 0, 33])
    kv_chunks = list(zip(_chunks(rng, dtype, B, 2, D, [7, 0, 40]),  # grouped K/V: 2 heads
                         _chunks(rng, dtype, B, 2, D, [7, 0, 40])))
    states = [new_state(q) for q in q_chunks]
    torch_cuda.attend_torch(q_chunks, kv_chunks[:2], states, scale, op=torch_cuda.cudnn_op)
    torch_cuda.attend_torch(q_chunks, kv_chunks[2:], states, scale, op=torch_cuda.cudnn_op)
    assert calls == [(38, 7, scale), (38, 40, scale)]  # Q chunks joined: one call per attend
    for q, s in zip(q_chunks, states):
        assert_state_matches(s, q, kv_chunks, scale, TOL[dtype])


def test_cudnn_backend_runs_a_single_key_on_the_torch_op(monkeypatch):
    """cuDNN takes no K/V of length 1: such a call runs on the torch backend's op."""
    calls, other = [], _cpu_op(pad_lse=1)
    monkeypatch.setattr(torch_cuda, "_cudnn_sdpa", _cpu_cudnn_sdpa(calls))
    monkeypatch.setattr(torch_cuda, "cuda_op", lambda q: other)
    torch.manual_seed(0)
    q = torch.randn(1, 2, 6, 64, dtype=torch.bfloat16)
    kv = [(torch.randn(1, 2, 1, 64, dtype=torch.bfloat16), torch.randn(1, 2, 1, 64, dtype=torch.bfloat16))]
    s = [new_state(q)]
    torch_cuda.attend_torch([q], kv, s, 0.125, op=torch_cuda.cudnn_op)
    assert calls == [] and [c[:2] for c in other.calls] == [(6, 1)]
    assert_state_matches(s[0], q, kv, 0.125, TOL[torch.bfloat16])


def test_cudnn_op_on_meta_tensors():
    """cuDNN's op as ``cudnn_op`` calls it (torch's meta kernel): output [B, H, Lq, D] in the
    query's layout, LSE fp32 [B, H, Lq, 1] read as [B, H, Lq]."""
    q = torch.empty(2, 45, 3, 128, device="meta", dtype=torch.bfloat16).transpose(1, 2)  # [B, H, L, D] view
    k = torch.empty(2, 3, 100, 128, device="meta", dtype=torch.bfloat16)
    raw = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, k, None, True, dropout_p=0.0,
                                                             is_causal=False, return_debug_mask=False,
                                                             scale=0.1)
    assert raw[1].shape == (2, 3, 45, 1) and raw[1].dtype == torch.float32
    out, lse = torch_cuda.cudnn_op(q, k, k, 0.1)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride() == q.stride()
    assert lse.shape == (2, 3, 45) and lse.dtype == torch.float32


def test_cudnn_choice_runs_through_the_cudnn_op(monkeypatch):
    _packages(monkeypatch, flash=False)
    monkeypatch.setattr(dispatch, "current_backend", lambda device, d, dt: "cudnn")
    ops = []
    monkeypatch.setattr(torch_cuda, "attend_torch", lambda q, kv, s, scale, op=None, **kw: ops.append(op))
    q = torch.zeros(1, 2, 3, 64, dtype=torch.bfloat16)
    dispatch.attend([q], [(q, q)], [new_state(q)], scale=0.1)
    assert ops == [torch_cuda.cudnn_op]
    assert dispatch.masked_backend(CUDA, "cudnn") == "torch"  # key masks: the torch backend


# ------------------------------------------------------------------ one op call + one combine
def _cpu_sdpa(q, k, v, scale):
    """torch's CPU attention op as an ``AttnOp`` (out [B, H, Lq, D], LSE fp32 [B, H, Lq])."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, scale=scale)[:2]


def test_torch_backend_finalizes_in_the_same_call():
    """``out`` given: the call writes acc / l of every chunk (rows without keys: 0), including
    a call with no keys at all (finalize only)."""
    torch.manual_seed(11)
    q_chunks = [torch.randn(1, 2, L, 40) for L in (6, 0, 13)]
    kv = [(torch.randn(1, 2, L, 40), torch.randn(1, 2, L, 40)) for L in (9, 4)]
    states = [new_state(q) for q in q_chunks]
    outs = [torch.full_like(q, float("nan")) for q in q_chunks]
    torch_cuda.attend_torch(q_chunks, kv, states, 0.2, op=_cpu_sdpa, out=outs)
    for q, o in zip(q_chunks, outs):
        ref_out, _ = reference(q, kv, 0.2)
        assert (o.double() - ref_out).abs().max().item() <= 1e-5 if q.numel() else o.numel() == 0
    fresh = [new_state(q) for q in q_chunks]
    torch_cuda.attend_torch(q_chunks, [], fresh, 0.2, op=_cpu_sdpa, out=outs)
    assert all(torch.equal(o, torch.zeros_like(o)) for o in outs)


@pytest.mark.parametrize("splits", [2, 4, 12])
def test_cudnn_split_call_batches_equal_kv_ranges(monkeypatch, splits):
    """A split cuDNN call: Q repeated ``splits`` times against the K/V ranges in ONE op call
    (batch ``splits * B``), the partials merged exactly."""
    calls = []
    monkeypatch.setattr(torch_cuda, "_cudnn_sdpa", _cpu_cudnn_sdpa(calls))
    torch.manual_seed(splits)
    q_chunks = [torch.randn(2, 3, L, 64, dtype=torch.bfloat16) for L in (10, 7)]
    kv = [tuple(torch.randn(2, 3, L, 64, dtype=torch.bfloat16) for _ in range(2)) for L in (24, 0, 24)]
    states = [new_state(q) for q in q_chunks]
    torch_cuda.attend_torch(q_chunks, kv, states, 0.125, op=torch_cuda.cudnn_op, kv_splits=splits)
    assert calls == [(17, 48 // splits, 0.125)]
    for q, s in zip(q_chunks, states):
        assert_state_matches(s, q, kv, 0.125, TOL[torch.bfloat16])
    with pytest.raises(ValueError, match="kv_splits must divide the joined K/V length 48"):
        torch_cuda.attend_torch(q_chunks, kv, states, 0.125, op=torch_cuda.cudnn_op, kv_splits=5)


def test_cudnn_split_ranges_copied_where_strided_views_are_refused(monkeypatch, caplog):
    """cuDNN refusing the K/V ranges as strided views (not known to happen): they are copied
    from then on, logged once, and the result is the same."""
    calls, refused = [], []

    def picky(q, k, v, *args, **kwargs):
        if not k.is_contiguous():
            refused.append(k.shape)
            raise RuntimeError("cuDNN Frontend error: No valid execution plans built.")
        return _cpu_cudnn_sdpa(calls)(q, k, v, *args, **kwargs)

    monkeypatch.setattr(torch_cuda, "_cudnn_sdpa", picky)
    monkeypatch.setattr(torch_cuda, "_split_views_refused", False)
    torch.manual_seed(12)
    q = torch.randn(1, 2, 9, 32, dtype=torch.bfloat16)
    kv = [tuple(torch.randn(1, 2, 16, 32, dtype=torch.bfloat16) for _ in range(2))]
    with caplog.at_level(logging.INFO, logger="xfuser.swiftfusion.kernels"):
        for _ in range(2):
            s = [new_state(q)]
            torch_cuda.attend_torch([q], kv, s, 0.2, op=torch_cuda.cudnn_op, kv_splits=4)
            assert_state_matches(s[0], q, kv, 0.2, TOL[torch.bfloat16])
    assert len(refused) == 1 and len(calls) == 2
    assert sum("copied from now on" in r.getMessage() for r in caplog.records) == 1


def test_split_count_fills_the_gpu_and_only_then():
    from xfuser_swiftfusion.kernels.combine import MAX_SPLITS, split_count

    assert split_count(132, 500, 132) == 1  # a full wave: no split
    assert split_count(60, 146, 132) == 2  # 120 programs, one wave of half the keys
    assert split_count(10, 400, 132) == 13  # 130 programs
    assert split_count(1, 10_000, 132) == MAX_SPLITS
    assert split_count(60, 6, 132) == 1  # too few K/V tiles to split
    assert split_count(100, 200, 132) == 5  # 500 programs: 95 % of 4 waves busy, 76 % of 1
    assert split_count(130, 200, 132) == 1  # two waves of half the work: no gain
    assert split_count(60, 146, 132, allowed=lambda s: s % 3 == 0) == 6  # 360 programs: 3 full waves
    assert split_count(60, 146, 132, allowed=lambda s: False) == 1
    assert split_count(0, 10, 132) == split_count(5, 10, 0) == 1


def test_cudnn_kv_splits_for_the_short_query_launches():
    """Flux 3072 px on 4 x 8, one GPU: 3 heads x 2336 queries (55 tiles) against 9344 keys on
    132 SMs: two ranges; a launch of 9344 queries fills the GPU unsplit."""
    assert torch_cuda.cudnn_kv_splits(3, 2336, 9344, 132) == 2
    assert torch_cuda.cudnn_kv_splits(3, 9344, 9344, 132) == 1
    assert torch_cuda.cudnn_kv_splits(3, 2336, 2 * 1163, 132) == 2  # a divisor of the keys
    assert torch_cuda.cudnn_kv_splits(3, 2336, 4651, 132) == 1  # a prime: no equal ranges


def test_pick_launch_splits_short_query_launches_along_kv():
    from xfuser_swiftfusion.kernels.triton_attend import TABLES, pick_launch

    full, small = TABLES[(128, 90)]
    # Pull-Q of Flux 3072 px: 2 x 1168 queries (20 tiles of 128) x 3 heads = 60 programs
    assert pick_launch(128, 90, [1168, 1168], [1168] * 8, 3, 132) == (full, 2)
    assert pick_launch(128, 90, [1168] * 8, [1168] * 2, 3, 132) == (full, 1)  # 240 programs
    assert pick_launch(128, 90, [1168, 1168], [64], 3, 132) == (small, 1)  # 1 K/V tile: no split
    assert pick_launch(64, 80, [100], [5000], 1, 108) == (TABLES[(64, 80)][0], 16)


# Ops that queue no device work (views and metadata) and ops that make the host wait for the
# device (a value read back, a data-dependent shape).
_NO_KERNEL = {"detach", "lift_fresh", "alias"}
_SYNCING = {"_local_scalar_dense", "item", "nonzero", "is_nonzero", "masked_select", "equal", "unique",
            "_unique2", "to_dense"}


def _device_ops(fn) -> list[str]:
    """Names of the aten ops ``fn`` dispatches that queue device work (no views)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    names = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if not func.is_view and name not in _NO_KERNEL:
                names.append(name)
            return func(*args, **(kwargs or {}))

    with Record():
        fn()
    return names


@pytest.mark.parametrize("masked", [False, True])
def test_sdpa_backend_call_queues_a_few_kernels_whatever_the_chunks(monkeypatch, masked):
    """What filled the GPU's launch queue and held the host back (H100 replay, cudnn and torch
    flash): a merge of about a dozen kernels per Q chunk. Now a backend call queues the joins,
    one op and one combine launch, however many chunks, and nothing that syncs the host."""
    from xfuser_swiftfusion.kernels import combine

    launched = []
    monkeypatch.setattr(combine, "uses_kernel", lambda device: True)
    monkeypatch.setattr(combine.CombinePlan, "__init__", lambda self, *a: launched.append(len(a[0])))
    monkeypatch.setattr(combine.CombinePlan, "launch", lambda self: None)
    monkeypatch.setattr(torch_cuda, "masked_efficient_op", lambda q, k, v, scale, bias: _cpu_sdpa(q, k, v, scale))
    counts = []
    for n_q in (2, 8):
        q_chunks = [torch.randn(1, 3, 16, 64) for _ in range(n_q)]
        kv = [(torch.randn(1, 3, 32, 64), torch.randn(1, 3, 32, 64)) for _ in range(2)]
        masks = [torch.rand(1, 32) > 0.5 for _ in kv] if masked else None
        states = [new_state(q) for q in q_chunks]
        outs = [torch.empty_like(q) for q in q_chunks]
        names = _device_ops(lambda: torch_cuda.attend_torch(q_chunks, kv, states, 0.1, None if masked else _cpu_sdpa,
                                                            key_masks=masks, out=outs))
        assert not _SYNCING & set(names), names
        counts.append(len(names))
    assert counts[0] == counts[1] <= (10 if masked else 4), counts  # cat K, V, Q, the op (+ the mask's bias)
    assert launched == [2, 8]  # one combine per call, over every chunk


# ------------------------------------------------------------------ measured choice table
def _write_table(tmp_path, archs, name="table.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps({"format": choice.FORMAT, "source": "fake GPU run", "archs": archs}))
    return str(path)


def test_a_measured_table_orders_the_automatic_choice(tmp_path, monkeypatch):
    _packages(monkeypatch, flash=True)
    monkeypatch.setenv(choice.TABLE_ENV, _write_table(tmp_path, {
        "sm90": {"128/bf16": {"order": ["cudnn", "triton"]}, "72/bf16": {"order": ["torch", "flash"]},
                 "64/fp32": {"order": ["cudnn", "torch"]}}}))
    pick = lambda d, dt, cap: dispatch.select_backend(CUDA, None, d, dt, cap)  # noqa: E731
    assert pick(128, torch.bfloat16, (9, 0)) == "cudnn"
    assert pick(72, torch.bfloat16, (9, 0)) == "torch"
    assert pick(64, torch.float32, (9, 0)) == "torch"  # cudnn listed first, cannot run fp32
    assert pick(128, torch.float16, (9, 0)) == "triton"  # no entry: the default rule
    assert pick(128, torch.bfloat16, (8, 0)) == "triton"  # no entry for sm80
    order, source = dispatch.auto_order(CUDA, 128, torch.bfloat16, (9, 0))
    assert order == ("cudnn", "triton", "flash", "torch") and "sm90" in source


def test_without_a_table_the_default_rule_holds(monkeypatch):
    _packages(monkeypatch, flash=True)
    assert choice.load_table(dispatch.BACKENDS) is None
    assert dispatch.auto_order(CUDA, 128, torch.bfloat16, (9, 0)) == (dispatch.AUTO_ORDER["cuda"], "default order")


@pytest.mark.parametrize("archs, message", [
    ({"sm90": {"128/bf16": {"order": ["fa3"]}}}, r"sm90 128/bf16: \"order\" must be a non-empty list"),
    ({"sm90": {"128/bf16": {"order": []}}}, r"\"order\" must be a non-empty list"),
    ({"sm90": ["cudnn"]}, r"sm90 must map shapes to entries"),
])
def test_a_malformed_table_is_an_error_naming_the_file(tmp_path, monkeypatch, archs, message):
    path = _write_table(tmp_path, archs)
    monkeypatch.setenv(choice.TABLE_ENV, path)
    with pytest.raises(ValueError, match=message) as err:
        dispatch.select_backend(CUDA, None, 128, torch.bfloat16, (9, 0))
    assert path in str(err.value)
    monkeypatch.setenv(choice.TABLE_ENV, str(tmp_path / "missing.json"))
    with pytest.raises(FileNotFoundError, match="no such kernel table"):
        dispatch.select_backend(CUDA, None, 128, torch.bfloat16, (9, 0))


def test_the_table_a_gpu_run_writes_is_the_table_the_dispatcher_reads(tmp_path, monkeypatch):
    doc = choice.table_document("sm90", {"128/bf16": {"triton": 0.31, "cudnn": 0.2, "torch": 0.4}},
                                "swiftfusion check --gpu-suite on a fake H100")
    assert doc["archs"]["sm90"]["128/bf16"]["order"] == ["cudnn", "triton", "torch"]
    path = tmp_path / "kernel-table.json"
    path.write_text(json.dumps(doc))
    monkeypatch.setenv(choice.TABLE_ENV, str(path))
    _packages(monkeypatch, flash=False)
    assert dispatch.select_backend(CUDA, None, 128, torch.bfloat16, (9, 0)) == "cudnn"


# ------------------------------------------------------------------ triton interpreter
def test_interpreter_problem_of_triton_before_3_7_with_numpy_2_4():
    assert "numpy >= 2.4 needs triton >= 3.7" in interpret.interpreter_problem_for("3.6.0", "2.5.2")
    assert interpret.interpreter_problem_for("3.6.0", "2.4.0rc1") is not None
    assert interpret.interpreter_problem_for("3.7.1", "2.5.2") is None
    assert interpret.interpreter_problem_for("3.6.0", "2.3.5") is None


def test_triton_on_cpu_needs_a_working_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _packages(monkeypatch, flash=False)
    monkeypatch.setattr(dispatch, "interpreter_problem", lambda: "the triton 3.6.0 interpreter fails")
    with pytest.raises(RuntimeError, match="kernel backend 'triton' needs a working interpreter on "
                                           "cpu: the triton 3.6.0 interpreter fails"):
        dispatch.select_backend(CPU, "triton", 64, torch.bfloat16)
    monkeypatch.setattr(dispatch, "interpreter_problem", lambda: None)
    assert dispatch.select_backend(CPU, "triton", 64, torch.bfloat16) == "triton"


# ------------------------------------------------------------------ flash backend
def _fake_flash_attn(calls):
    def flash_attn_func(q, k, v, softmax_scale, return_attn_probs):
        """flash_attn_func's contract in fp64: [B, L, H, D] in, (out [B, L, H, D] in q's
        dtype, lse [B, H, L] fp32, probs) out."""
        assert return_attn_probs and k.shape == v.shape and q.stride(-1) == 1
        calls.append((q.shape[1], k.shape[1]))
        out, lse = attention_lse(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale)
        return out.transpose(1, 2).to(q.dtype), lse.float(), None

    return flash_attn_func


@pytest.mark.parametrize("D", [64, 72, 88])
def test_flash_backend_one_call_on_joined_q_and_kv(monkeypatch, D):
    calls = []
    monkeypatch.setattr(flash_backend, "_flash_attn_func", lambda: _fake_flash_attn(calls))
    rng = random.Random(D)
    torch.manual_seed(D)
    B, H, scale = 2, 3, 0.125
    q_chunks = _chunks(rng, torch.bfloat16, B, H, D, [4, 0, 17])
    kv_chunks = list(zip(_chunks(rng, torch.bfloat16, B, H, D, [3, 0, 9, 20]),
                         _chunks(rng, torch.bfloat16, B, H, D, [3, 0, 9, 20])))  # fmt: skip
    states = [new_state(q) for q in q_chunks]
    flash_backend.attend_flash(q_chunks, kv_chunks[:3], states, scale)
    flash_backend.attend_flash(q_chunks, kv_chunks[3:], states, scale)
    assert calls == [(21, 12), (21, 20)]  # Q chunks joined: one call per attend
    for q, s in zip(q_chunks, states):
        assert_state_matches(s, q, kv_chunks, scale, TOL[torch.bfloat16])


# ------------------------------------------------------------------ triton table
def test_table_serves_each_gpu():
    from xfuser_swiftfusion.kernels.triton_attend import table_for

    assert {sm: table_for(sm) for sm in (75, 80, 86, 87, 89, 90, 100, 103, 110, 120, 121)} == {
        75: 80, 80: 80, 86: 86, 87: 80, 89: 86, 90: 90, 100: 90, 103: 90, 110: 90, 120: 86, 121: 86}


def test_pick_config_takes_smaller_query_tiles_for_small_grids():
    from xfuser_swiftfusion.kernels.triton_attend import TABLES, pick_config, q_tiles

    full, small = TABLES[(128, 90)]
    assert small.block_m < full.block_m
    # one machine's query block of Flux 3072 px on 4 x 8: 2304 rows x 3 heads = 54 programs
    assert q_tiles([2304], full.block_m) * 3 == 54
    assert pick_config(128, 90, [2304], 3, 132) == small
    assert q_tiles([2304], small.block_m) * 3 == 108
    assert pick_config(128, 90, [9344], 3, 132) == full  # 219 programs
    assert pick_config(128, 90, [1152, 1152], 3, 54) == full  # exactly one per SM
    assert pick_config(128, 90, [1152, 1152], 3, 55) == small
    assert pick_config(64, 80, [100, 1, 1], 8, 108) == TABLES[(64, 80)][1]  # 3 + 1 + 1 tiles
    assert pick_config(64, 86, [1000], 0, 0) == TABLES[(64, 86)][0]
    assert pick_config(128, 9) == pick_config(128, 90) == full  # a major version means x.0


def _gpu_refusing_all_but_safe(monkeypatch, sm: int, sms: int) -> list:
    """triton_attend on a fake GPU (``sm``, ``sms`` SMs) that refuses every configuration but
    SAFE_CONFIG (OutOfResources, raised before anything runs); returns the (configuration,
    splits) of each launch tried."""
    from triton.runtime.errors import OutOfResources

    from xfuser_swiftfusion.kernels import triton_attend as ta

    monkeypatch.setattr(ta, "_device_info", lambda index: (sm, sms))
    monkeypatch.setattr(ta, "_rejected", set())
    launched = []

    def launch(plan, ready):
        launched.append((ready.cfg, ready.n_split))
        if ready.cfg != ta.SAFE_CONFIG:
            raise OutOfResources(300_000, 101_376, "shared memory")

    monkeypatch.setattr(ta._Plan, "launch", launch)
    return launched


def test_rejected_config_falls_back_to_the_safe_one(monkeypatch):
    """A GPU that refuses the tabled configuration gets SAFE_CONFIG, now and for later
    launches."""
    from xfuser_swiftfusion.kernels import triton_attend as ta

    launched = _gpu_refusing_all_but_safe(monkeypatch, 120, 8)  # 16 programs fill 8 SMs
    q = torch.zeros(1, 2, 1000, 128, dtype=torch.bfloat16)
    for _ in range(2):
        ta.attend_triton([q], [(q, q)], [new_state(q)], 0.1)
    assert launched == [(ta.TABLES[(128, 86)][0], 1), (ta.SAFE_CONFIG, 1), (ta.SAFE_CONFIG, 1)]


def test_prepared_launch_a_gpu_refuses_falls_back_to_the_safe_one(monkeypatch):
    """``prepare_triton``'s launch: a refused configuration (split here) is replaced by
    SAFE_CONFIG unsplit at that call and for the device's later launches."""
    from xfuser_swiftfusion.kernels import triton_attend as ta

    launched = _gpu_refusing_all_but_safe(monkeypatch, 90, 132)
    q = torch.zeros(1, 3, 2336, 128, dtype=torch.bfloat16)
    kv = [(torch.zeros(1, 3, 9344, 128, dtype=torch.bfloat16),) * 2]
    run = ta.prepare_triton([q], kv, [new_state(q)], 0.1)
    run()
    run()
    assert launched == [(ta.TABLES[(128, 90)][0], 2), (ta.SAFE_CONFIG, 1), (ta.SAFE_CONFIG, 1)]
    assert ta.launch_choice(CPU, 128, [2336], [9344], 3) == (ta.SAFE_CONFIG, 1)


# Per-block shared memory limits (cudaDevAttrMaxSharedMemoryPerBlockOptin).
SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 120: 101376, 90: 232448, 100: 232448}


def _aot_cases():
    from xfuser_swiftfusion.kernels.triton_attend import SAFE_CONFIG, TABLE_ARCHS, TABLES

    cases = {}
    for (D, table), cfgs in TABLES.items():
        for cfg in cfgs:
            for arch in TABLE_ARCHS[table]:
                cases[(D, arch, cfg)] = None
    for D in (32, 64, 128):
        for arch in (80, 86, 90):
            cases[(D, arch, SAFE_CONFIG)] = None
    return list(cases)


def _can_compile() -> bool:
    try:
        from xfuser_swiftfusion.kernels.triton_attend import KernelConfig, aot_compile, resource_usage

        resource_usage(aot_compile(32, torch.float16, 80, cfg=KernelConfig(32, 32, 1, 1)))
        return True
    except Exception:
        return False


@pytest.fixture(scope="module")
def compiler():
    if not _can_compile():
        pytest.skip("triton cannot compile for sm_80 here (no CUDA backend or ptxas)")
    from xfuser_swiftfusion.kernels.triton_attend import aot_compile, resource_usage

    return lambda D, dtype, arch, finalize, cfg: resource_usage(aot_compile(D, dtype, arch, finalize, cfg))


@pytest.mark.parametrize("D,arch,cfg", _aot_cases(), ids=lambda x: f"{x}" if not hasattr(x, "block_m") else
                         f"{x.block_m}x{x.block_n}w{x.num_warps}s{x.num_stages}")  # fmt: skip
def test_table_entry_fits_without_spills(compiler, D, arch, cfg):
    """Every variant of the attention kernel an entry launches: finalizing (bf16), not
    finalizing (fp16), split along K/V (partials to the workspace)."""
    from xfuser_swiftfusion.kernels.triton_attend import aot_compile, resource_usage

    for dtype, finalize in ((torch.bfloat16, True), (torch.float16, False)):
        usage = compiler(D, dtype, arch, finalize, cfg)
        assert 0 < usage["shared"] <= SHARED_LIMIT[arch], usage
        assert usage["registers"] <= 255 and usage["stack"] == 0, f"register spills ({dtype}, {finalize}): {usage}"
    usage = resource_usage(aot_compile(D, torch.bfloat16, arch, cfg=cfg, split=True))
    assert 0 < usage["shared"] <= SHARED_LIMIT[arch], usage
    assert usage["registers"] <= 255 and usage["stack"] == 0, f"register spills (split): {usage}"


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("D", [32, 72, 128, 256])
def test_combine_kernel_fits_without_spills(compiler, D, arch):
    """The combine kernel over the head dims the backends run (its tiles are D rounded up to a
    power of two: 72 stands for 72-128, 256 for 136-256), partials in bf16 (SDPA ops) and fp32
    (the split workspace), with and without vector loads (``aligned``)."""
    from xfuser_swiftfusion.kernels import combine
    from xfuser_swiftfusion.kernels.triton_attend import resource_usage

    for part, out, finalize, dead, aligned in ((torch.bfloat16, torch.bfloat16, True, False, True),
                                               (torch.float32, torch.float16, True, False, False),
                                               (torch.float32, torch.float32, False, True, True)):
        usage = resource_usage(combine.aot_compile(D, part, out, arch, finalize, dead, aligned))
        assert usage["shared"] <= SHARED_LIMIT[arch], usage
        assert usage["registers"] <= 255 and usage["stack"] == 0, f"register spills ({part}, {out}): {usage}"


# --------------------------------------------- triton table numerics (interpreter subprocess)
def _interpreter_shapes():
    from xfuser_swiftfusion.kernels.triton_attend import SAFE_CONFIG, TABLES

    shapes = {(D, c.block_m, c.block_n) for (D, _), cfgs in TABLES.items() for c in cfgs}
    shapes |= {(D, SAFE_CONFIG.block_m, SAFE_CONFIG.block_n) for D in (32, 64, 128)}
    return sorted(shapes)


def _table_case(D: int, bm: int, bn: int, dtype: torch.dtype, name: str) -> None:
    """One table tile shape: chunks across tile boundaries over two calls, the second
    finalizing, against the fp64 reference."""
    from xfuser_swiftfusion.kernels.triton_attend import KernelConfig, attend_triton

    cfg = KernelConfig(bm, bn, 4, 2)
    rng = random.Random(name)
    torch.manual_seed(rng.randint(0, 2**31))
    scale = D**-0.5
    q_chunks = _chunks(rng, dtype, 1, 2, D, [1, bm - 1, bm + 1, 0])
    kv = list(zip(_chunks(rng, dtype, 1, 2, D, [bn + 3, 0, 1]), _chunks(rng, dtype, 1, 2, D, [bn + 3, 0, 1])))
    kv += list(zip(_chunks(rng, dtype, 1, 2, D, [2 * bn]), _chunks(rng, dtype, 1, 2, D, [2 * bn])))
    states = [new_state(q) for q in q_chunks]
    outs = [torch.empty_like(q, memory_format=torch.contiguous_format) for q in q_chunks]
    attend_triton(q_chunks, kv[:2], states, scale, cfg=cfg)
    attend_triton(q_chunks, kv[2:], states, scale, out=outs, cfg=cfg)
    for q, s, o in zip(q_chunks, states, outs):
        assert_state_matches(s, q, kv, scale, TOL[dtype])
        ref_out, _ = reference(q, kv, scale)
        err = (o.double() - ref_out).abs().max().item() if o.numel() else 0.0
        assert err <= TOL[dtype], f"finalized output error {err:.3g}"


def _interpreter_cases() -> dict:
    """Every table tile shape in three dtypes (run under TRITON_INTERPRET=1)."""
    cases = {}
    for D, bm, bn in _interpreter_shapes():
        for dtype in DTYPES:
            name = f"D{D}-{bm}x{bn}-{str(dtype).removeprefix('torch.')}"
            cases[name] = functools.partial(_table_case, D, bm, bn, dtype, name)
    return cases


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, str]:
    return run_cases_in_subprocess(__file__)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("shape", _interpreter_shapes(), ids=lambda s: f"D{s[0]}-{s[1]}x{s[2]}")
def test_table_tiles_match_reference_under_interpreter(interpreter_results, shape, dtype):
    assert "__subprocess__" not in interpreter_results, interpreter_results["__subprocess__"]
    D, bm, bn = shape
    name = f"D{D}-{bm}x{bn}-{str(dtype).removeprefix('torch.')}"
    assert interpreter_results.get(name) == "ok", interpreter_results.get(name, "case did not run")


if __name__ == "__main__":
    report(_interpreter_cases())
