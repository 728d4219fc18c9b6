"""Kernel checks of the GPU suite: numerics against fp64 (the triton kernel, cuDNN's attention,
auto's choice for the other shapes), one launch per configuration (for compute-sanitizer),
speed of every backend on the launches the Torus stages make (for Nsight Compute and the
measured kernel table too).

Inputs are drawn fresh per case; half of the chunks are ``[B, L, H, D]`` buffers seen as
``[B, H, L, D]`` (the layout attention layers hand over), the others contiguous. Outputs are
poisoned with NaN before a finalizing launch, so an element the kernel does not write fails.
"""
from __future__ import annotations

import contextlib
import functools
import math
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ...kernels import attend, current_backend, new_state, select_backend, set_backend
from ...kernels.choice import arch_key, shape_key
from .report import RowWriter
from .timing import call_ms, kernel_ms

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2}
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
TRITON_DIMS = (32, 64, 128)
# (head dim, dtype) the triton kernel does not take: auto picks flash-attn or torch's CUDA ops
FALLBACK_SHAPES = ((72, torch.bfloat16), (88, torch.bfloat16), (96, torch.float16),
                   (256, torch.bfloat16), (64, torch.float32), (128, torch.float32))


def _chunk(B: int, H: int, L: int, D: int, dtype: torch.dtype, device: torch.device,
           strided: bool) -> torch.Tensor:
    """A random ``[B, H, L, D]`` chunk: a view of a ``[B, L, H, D]`` buffer if ``strided``."""
    if strided:
        return torch.randn(B, L, H, D, device=device).to(dtype).transpose(1, 2)  # [B, H, L, D] view
    return torch.randn(B, H, L, D, device=device).to(dtype)


def reference(qs: list[torch.Tensor], kvs: list[tuple[torch.Tensor, torch.Tensor]], scale: float
              ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """fp64 softmax attention of every Q chunk over all K/V chunks: (outputs [B, H, Lq, D],
    LSE [B, H, Lq]); K/V heads are repeated for grouped-query chunks."""
    H = qs[0].shape[1]
    k = torch.cat([k for k, _ in kvs], dim=2).double()                  # [B, H_kv, Lk, D]
    v = torch.cat([v for _, v in kvs], dim=2).double()
    k, v = (x.repeat_interleave(H // x.shape[1], dim=1) for x in (k, v))  # [B, H, Lk, D]
    outs, lses = [], []
    for q in qs:
        s = q.double() @ k.transpose(-1, -2) * scale                    # [B, H, Lq, Lk]
        lse = torch.logsumexp(s, dim=-1)                                # [B, H, Lq]
        outs.append(torch.exp(s - lse[..., None]) @ v)
        lses.append(lse)
    return outs, lses


def _lengths(rng: random.Random, count: tuple[int, int], longest: int, empty: float) -> list[int]:
    """Ragged chunk lengths, some 0 (probability ``empty``), not all 0."""
    n = rng.randint(*count)
    lens = [0 if rng.random() < empty else rng.randint(1, longest) for _ in range(n)]
    if not any(lens):
        lens[rng.randrange(n)] = rng.randint(1, longest)
    return lens


def numerics_case(device: torch.device, D: int, dtype: torch.dtype, finalize: bool, seed: int,
                  longest: int = 300, batch: int = 2, heads: int = 4, n_split: int | None = None) -> dict:
    """One random chunking in two launches that carry the running state: errors of the output
    and the LSE against ``reference`` (the output is acc / l of the state when not
    finalizing). Grouped-query K/V (half the heads) on odd seeds. ``n_split``: the triton
    kernel called directly, split along K/V into that many ranges (its combine included)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    heads_kv = heads // 2 if seed % 2 else heads
    q_lens = _lengths(rng, (1, 3), longest, 0.2)
    kv_lens = _lengths(rng, (1, 5), longest, 0.3)
    qs = [_chunk(batch, heads, n, D, dtype, device, rng.random() < 0.5) for n in q_lens]
    kvs = [(_chunk(batch, heads_kv, n, D, dtype, device, s), _chunk(batch, heads_kv, n, D, dtype, device, s))
           for n, s in ((n, rng.random() < 0.5) for n in kv_lens)]
    scale = D ** -0.5
    states = [new_state(q) for q in qs]
    split = rng.randint(0, len(kvs))  # first launch kvs[:split] (maybe none), second the rest
    call = attend
    if n_split is not None:
        from ...kernels.triton_attend import attend_triton

        def call(q, kv, st, scale, finalize=False, out=None):
            attend_triton(q, kv, st, scale, out=out if finalize else None, n_split=n_split)
    call(qs, kvs[:split], states, scale=scale)
    if finalize:
        outs = [torch.full(q.shape, float("nan"), dtype=dtype, device=device) for q in qs]
        call(qs, kvs[split:], states, scale=scale, finalize=True, out=outs)
    else:
        call(qs, kvs[split:], states, scale=scale)
        outs = [s.acc / s.l[..., None] for s in states]
    ref_out, ref_lse = reference(qs, kvs, scale)
    lses = [s.m + torch.log(s.l) for s in states]
    err = max((o.double() - r).abs().max().item() if o.numel() else 0.0 for o, r in zip(outs, ref_out))
    lse_err = max((x.double() - r).abs().max().item() if x.numel() else 0.0 for x, r in zip(lses, ref_lse))
    num = sum(((o.double() - r) ** 2).sum().item() for o, r in zip(outs, ref_out))
    den = sum((r ** 2).sum().item() for r in ref_out)
    return {"err": err, "lse_err": lse_err, "rel": math.sqrt(num / den) if den else 0.0,
            "finite": all(bool(torch.isfinite(x).all()) for x in (*outs, *lses)),
            "q_lens": q_lens, "kv_lens": kv_lens, "split": split, "heads_kv": heads_kv,
            "backend": current_backend(device, D, dtype)}


@contextlib.contextmanager
def backend(name: str | None) -> Iterator[None]:
    """Every ``attend`` call inside runs backend ``name`` (automatic choice again after)."""
    set_backend(name)
    try:
        yield
    finally:
        set_backend(None)


def _triton() -> contextlib.AbstractContextManager[None]:
    return backend("triton")


def cannot_run(name: str, device: torch.device, D: int, dtype: torch.dtype) -> str | None:
    """Why backend ``name`` cannot run (head dim ``D``, ``dtype``) here, or None."""
    try:
        select_backend(device, name, D, dtype)
    except (RuntimeError, ValueError) as exc:
        return str(exc)
    return None


def _triton_configs(device: torch.device) -> Iterator[tuple[int, torch.dtype, bool]]:
    """(head dim, dtype, finalize) of every triton configuration; on CPU (the interpreter) a
    small subset, to exercise the suite itself."""
    cpu = device.type != "cuda"
    for D in (32, 64) if cpu else TRITON_DIMS:
        for dtype in (torch.bfloat16,) if cpu else (torch.bfloat16, torch.float16):
            for finalize in (True, False):
                yield D, dtype, finalize


def _case_name(D: int, dtype: torch.dtype, finalize: bool) -> str:
    return f"D{D} {DTYPE_NAMES[dtype]} finalize {'on' if finalize else 'off'}"


def _passes(result: dict, tol: float) -> bool:
    """Output and LSE finite and within ``tol`` of fp64."""
    return result["finite"] and result["err"] <= tol and result["lse_err"] <= tol


def _numerics_row(w: RowWriter, case: str, device: torch.device, D: int, dtype: torch.dtype,
                  finalize: bool, seeds: range, longest: int, n_split: int | None = None) -> None:
    try:
        results = [numerics_case(device, D, dtype, finalize, s, longest, n_split=n_split) for s in seeds]
    except Exception as exc:  # noqa: BLE001  (a backend's error is this row's failure)
        w.add(case, "FAIL", f"{type(exc).__name__}: {exc}"[:400])
        return
    worst = max(results, key=lambda r: max(r["err"], r["lse_err"]))
    tol = TOLERANCE[dtype]
    ok = all(_passes(r, tol) for r in results)
    w.check(case, ok, f"{worst['backend']}: max err {worst['err']:.2e}, LSE {worst['lse_err']:.2e}, "
            f"rel {worst['rel']:.1e} (tol {tol:g}; {len(results)} chunkings)",
            worst=worst, cases=len(results), tolerance=tol)


CUDNN_SHAPES = ((64, torch.bfloat16), (128, torch.bfloat16), (64, torch.float16), (128, torch.float16))


def numerics(w: RowWriter, device: torch.device, quick: bool = False) -> None:
    """Triton at D 32/64/128, bf16 and fp16, finalize on and off, also split along K/V (3
    ranges and the combine); cuDNN's attention (its LSE layout and units, the combine) at D
    64/128; then what auto picks for the head dims and dtypes the kernel does not take. On CPU (``TRITON_INTERPRET=1``): a small subset, to exercise the suite
    itself, or SKIP rows where the interpreter does not work with this numpy."""
    cpu = device.type != "cuda"
    seeds = range(2 if cpu else (4 if quick else 8))
    longest = 40 if cpu else 300
    why = cannot_run("triton", device, 64, torch.bfloat16)
    if why is not None:
        w.add("triton", "SKIP", why)
    else:
        with _triton():
            for D, dtype, fin in _triton_configs(device):
                _numerics_row(w, f"triton {_case_name(D, dtype, fin)}", device, D, dtype, fin, seeds, longest)
            if not cpu:  # every config split along K/V (3 ranges), its combine finalizing or not
                for D, dtype, fin in _triton_configs(device):
                    _numerics_row(w, f"triton split-K/V {_case_name(D, dtype, fin)}", device, D, dtype, fin,
                                  seeds, longest, n_split=3)
    if cpu:
        return
    why = cannot_run("cudnn", device, 128, torch.bfloat16)
    if why is not None:
        w.add("cudnn", "SKIP", why)
    else:
        with backend("cudnn"):
            for D, dtype in CUDNN_SHAPES:
                for fin in (True, False):
                    _numerics_row(w, f"cudnn {_case_name(D, dtype, fin)}", device, D, dtype, fin, seeds, longest)
    for D, dtype in FALLBACK_SHAPES:  # auto's choice for shapes triton does not take
        _numerics_row(w, f"auto D{D} {DTYPE_NAMES[dtype]}", device, D, dtype, True, seeds, longest)


def launches(w: RowWriter, device: torch.device) -> None:
    """One small launch of every triton configuration (D, dtype, finalize, grouped K/V, split
    along K/V with its combine) and, where cuDNN runs, cuDNN's op with the combine kernel,
    each checked against fp64: the program compute-sanitizer runs."""
    longest = 160 if device.type == "cuda" else 24
    why = cannot_run("triton", device, 64, torch.bfloat16)
    if why is not None:
        w.add("triton", "SKIP", why)
        return
    with _triton():
        for D, dtype, fin in _triton_configs(device):
            for seed, n_split in ((0, None), (1, None), (2, 3)):  # seed 1: grouped K/V; 3 K/V ranges
                r = numerics_case(device, D, dtype, fin, seed, longest, batch=1, heads=2, n_split=n_split)
                name = _case_name(D, dtype, fin) + (" gqa" if r["heads_kv"] == 1 else "")
                w.check(f"launch {name}{' split 3' if n_split else ''}", _passes(r, TOLERANCE[dtype]),
                        f"err {r['err']:.1e}", **r)
    if device.type == "cuda" and cannot_run("cudnn", device, 64, torch.bfloat16) is None:
        with backend("cudnn"):  # cuDNN's op and the combine kernel
            for D in (64, 128):
                r = numerics_case(device, D, torch.bfloat16, True, 3, longest, batch=1, heads=2)
                w.check(f"launch cudnn + combine D{D} bf16", _passes(r, TOLERANCE[torch.bfloat16]),
                        f"err {r['err']:.1e}", **r)
    if device.type == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------
# Speed: the launches of the Torus stages.

@dataclass(frozen=True)
class ModelShape:
    """One attention layer of a model: heads, head dim, tokens of the whole sequence (text
    included); ``joint``: of those, the text tokens the model passes as joint tensors."""

    name: str
    heads: int
    head_dim: int
    tokens: int
    joint: int = 0


# Flux 3072 px: (3072/16)^2 = 36864 image tokens + 512 text; 4096 px: 65536 + 512 (the Flux
# runner passes text in the sequence). CogVideoX 5B, 49 frames of 720x480: 13 latent frames x
# 30 x 45 patches = 17550 + 226 text (passed as joint tensors: ``joint``).
MODELS = (ModelShape("Flux 3072px", 24, 128, 36864 + 512),
          ModelShape("Flux 4096px", 24, 128, 65536 + 512),
          ModelShape("CogVideoX-5B", 48, 64, 17550 + 226, joint=226))
# CPU stand-ins (``--allow-cpu``): the same heads, head dims and 4 x 8 schedule, few tokens
CPU_MODELS = (ModelShape("Flux-like (CPU stand-in)", 24, 128, 32 * 12),
              ModelShape("CogVideoX-like (CPU stand-in)", 48, 64, 32 * 6 + 10, joint=10))


def models(device: torch.device) -> tuple[ModelShape, ...]:
    """The models the speed and replay stages measure on ``device``."""
    return MODELS if device.type == "cuda" else CPU_MODELS


@dataclass(frozen=True)
class Launch:
    """One fused launch: Q chunks and K/V chunks of ``heads`` heads, [1, heads, L, D] each;
    ``count``: launches of this shape in one layer; ``mode``: "torus" (one launch per ring
    step, as the strategies launch today) or "fused" (one launch per Torus stage and query
    entries over every K/V chunk present)."""

    name: str
    heads: int
    head_dim: int
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    count: int = 1
    mode: str = "torus"

    @property
    def flops(self) -> float:
        """Non-causal attention: 4 * H * sum(Lq) * sum(Lk) * D (two matmuls)."""
        return 4.0 * self.heads * sum(self.q_lens) * sum(self.kv_lens) * self.head_dim


def schedule_launches(model: ModelShape, nodes: int = 4, gpus_per_node: int = 8, fused: bool = False) -> list[Launch]:
    """The distinct launches one GPU (machine 0) makes in a layer of ``swiftfusion`` on ``nodes``
    x ``gpus_per_node``, with their counts, walked from ``torus_schedule``. A query entry is U
    chunks ``[1, h, S, D]`` (a machine's; ``h`` = H' / (T * U) with H' the padded head count
    the strategy runs, S = ceil(image tokens / W)) or the text rows ``[1, h, Tj, D]``. Each
    ``attend`` step of query entries over a machine's K/V block is, ``fused=False``, a ring
    attention of R launches of its query chunks against U K/V chunks (and over the text K/V
    one launch); ``fused=True``, the launches of ``fused_schedule`` (``launches="stage"``):
    one per stage and query entries, against every K/V chunk present (a block's U * R chunks,
    the text K/V)."""
    from collections import Counter

    from ...mesh import torus_mesh
    from ...strategies.torus import TEXT, fused_schedule, torus_schedule
    from ...topology import Topology
    topo = Topology(nodes, gpus_per_node)
    mesh, heads = torus_mesh(topo, model.heads)
    T, U, R = mesh.torus, mesh.ulysses_intra, mesh.ring
    h, S, Tj = heads // (T * U), -(-(model.tokens - model.joint) // topo.world_size), model.joint

    def chunks(entries, per_machine: int) -> tuple[int, ...]:
        return tuple(n for e in entries for n in ((Tj,) if e == TEXT else (S,) * per_machine))

    counts: Counter = Counter()
    if fused:  # the launches the strategy makes with launches="stage"
        for step in fused_schedule(T, 0, bool(Tj)):
            if step.kind == "launch" and step.kv:
                counts[(chunks(step.q, U), chunks(step.kv, U * R))] += 1
    else:
        for step in torus_schedule(T, 0, bool(Tj)):
            if step.kind == "attend":
                counts[(chunks(step.q, U), chunks((step.kv,), U))] += 1 if step.kv == TEXT else R

    def name(q_lens, kv_lens) -> str:
        text = f" (+text {Tj})" if Tj and (Tj in q_lens or Tj in kv_lens) and Tj != S else ""
        kind = "fused " if fused else ""
        return f"{model.name} {topo}: {kind}{len(q_lens)}Q x {len(kv_lens)}KV of {S}{text}, h{h}"

    return [Launch(name(q, kv), h, model.head_dim, q, kv, n, "fused" if fused else "torus")
            for (q, kv), n in counts.items()]


def torus_launches(model: ModelShape, nodes: int = 4, gpus_per_node: int = 8) -> list[Launch]:
    """The distinct ring-step launches over machines' K/V blocks (no text K/V) one GPU makes in
    a layer of ``swiftfusion`` (``schedule_launches``, not fused): each of ``n * U`` Q chunks
    against U K/V chunks."""
    return [x for x in schedule_launches(model, nodes, gpus_per_node) if model.joint not in x.kv_lens
            or not model.joint]


def _inputs(launch: Launch, dtype: torch.dtype, device: torch.device):
    """Q chunks and K/V chunks as ``[B, L, H, D]`` buffers seen as ``[B, H, L, D]``."""
    make = lambda n: _chunk(1, launch.heads, n, launch.head_dim, dtype, device, True)  # noqa: E731
    return [make(n) for n in launch.q_lens], [(make(n), make(n)) for n in launch.kv_lens]


def run_launch(launch: Launch, dtype: torch.dtype, device: torch.device, repeat: int = 2) -> None:
    """``repeat`` launches of the prepared triton kernel of ``launch`` (the program Nsight
    Compute profiles: the launch alone, its table built once)."""
    from ...kernels.triton_attend import prepare_triton
    qs, kvs = _inputs(launch, dtype, device)
    go = prepare_triton(qs, kvs, [new_state(q) for q in qs], launch.head_dim ** -0.5)
    for _ in range(repeat):
        go()
    torch.cuda.synchronize()


# the backends a layer can run, as the speed and replay stages name them
GPU_BACKENDS = ("triton", "cudnn", "torch", "flash")
LABELS = {"torch": "torch-flash", "flash": "flash-attn"}
CPU_TRITON = ("CPU stand-ins: the triton interpreter would take minutes on these launches "
              "(the numerics stage runs it)")


def runnable(w: RowWriter | None, device: torch.device, D: int, dtype: torch.dtype) -> list[str]:
    """The backends of ``attend`` that the speed and replay stages run for (``D``, ``dtype``)
    here (on CPU: the ``cpu`` stand-in); a SKIP row (into ``w``) names why each GPU backend
    does not run."""
    names = []
    for name in (*GPU_BACKENDS, "cpu"):
        why = cannot_run(name, device, D, dtype)
        if why is None and name == "triton" and device.type != "cuda":
            why = CPU_TRITON
        if why is None:
            names.append(name)
        elif w is not None and name != "cpu":
            w.add(f"{LABELS.get(name, name)} D{D} {DTYPE_NAMES[dtype]}", "SKIP", why)
    return names


def _op_calls(name: str, qs, kvs, scale: float):
    """The attention op of backend ``name`` once on every Q chunk joined and every K/V chunk
    joined, inputs joined beforehand (no merge): the single-kernel bound of a launch."""
    from ...kernels import torch_cuda
    from ...kernels.flash import _blhd
    if name == "flash":  # as the flash backend: joined in flash-attn's [B, L, H, D]
        from flash_attn import flash_attn_func
        qb, kb, vb = _blhd(qs), _blhd([k for k, _ in kvs]), _blhd([v for _, v in kvs])
        return lambda: flash_attn_func(qb, kb, vb, softmax_scale=scale)
    q = torch.cat(qs, dim=2)  # [1, h, sum Lq, D]
    k = torch.cat([k for k, _ in kvs], dim=2)  # [1, h, sum Lk, D]
    v = torch.cat([v for _, v in kvs], dim=2)
    if name == "cpu":
        op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        return lambda: op(q, k, v, scale=scale)
    op = torch_cuda.cudnn_op if name == "cudnn" else torch_cuda.cuda_op(q)
    return lambda: op(q, k, v, scale)


def _kernel_fn(name: str, qs, kvs, scale: float, **how):
    """Backend ``name``'s whole call on the launch, merge included, prepared once where the
    backend can be (triton: ``prepare_triton``; cudnn, torch: ``prepare_torch``, its joins,
    op and combine; flash-attn, cpu: the call itself). ``how``: triton's ``cfg`` and
    ``n_split``, cudnn's ``kv_splits``."""
    states = [new_state(q) for q in qs]
    if name == "triton":
        from ...kernels.triton_attend import prepare_triton
        return prepare_triton(qs, kvs, states, scale, **how)
    if name in ("cudnn", "torch"):
        from ...kernels.torch_cuda import cudnn_op, prepare_torch
        return prepare_torch(qs, kvs, states, scale, op=cudnn_op if name == "cudnn" else None, **how)
    if name == "flash":
        from ...kernels.flash import attend_flash
        return lambda: attend_flash(qs, kvs, states, scale)
    from ...kernels.cpu import attend_cpu
    return lambda: attend_cpu(qs, kvs, states, scale)


def _single_call(name: str, qs, kvs, scale: float):
    """One op call on every Q chunk and every K/V chunk concatenated (no merge): the bound a
    single kernel sets for the launch."""
    return _op_calls(name, qs, kvs, scale)


def _single_with_combine(qs, kvs, scale: float):
    """One cuDNN call on the launch's Q and K/V joined beforehand, unsplit, and the fused
    combine of its (out, lse) into one running state: the single call with its merge."""
    q = torch.cat(qs, dim=2)  # [1, h, sum Lq, D]
    kv = (torch.cat([k for k, _ in kvs], dim=2), torch.cat([v for _, v in kvs], dim=2))
    return _kernel_fn("cudnn", [q], [kv], scale, kv_splits=1)


# Candidate configurations the speed stage times on sm_90 besides the table's (DESIGN:
# measured, not assumed): AOT resource use of each in docs/gpu-suite.md.
SM90_CANDIDATES = {
    128: ((128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2), (128, 32, 8, 3), (64, 64, 8, 3), (64, 128, 4, 2)),
    64: ((128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (128, 32, 8, 3), (64, 64, 4, 3), (64, 128, 4, 2)),
    32: ((128, 64, 4, 3), (64, 64, 8, 3), (128, 128, 8, 2)),
}


def triton_variants(launch: Launch, device: torch.device, quick: bool) -> list[tuple[str, dict]]:
    """(label, ``prepare_triton`` arguments) of the triton launches the speed stage times
    besides the default choice: each candidate configuration (``SM90_CANDIDATES`` on sm_90,
    the table's entries elsewhere) unsplit and, where the default splits or the grid is short
    of a wave, split as the default is; the default configuration also split twice as much."""
    from ...kernels.triton_attend import (SAFE_CONFIG, TABLES, KernelConfig, _device_info, launch_choice,
                                          q_tiles, table_for)
    sm, sms = _device_info(device.index)
    default = launch_choice(device, launch.head_dim, launch.q_lens, launch.kv_lens, launch.heads)
    if table_for(sm) == 90:
        configs = [KernelConfig(*c) for c in SM90_CANDIDATES[launch.head_dim]]
    else:
        configs = [*TABLES[(launch.head_dim, table_for(sm))], SAFE_CONFIG]
    if quick:
        configs = configs[:3]
    out = []
    for cfg in configs:
        short = q_tiles(launch.q_lens, cfg.block_m) * launch.heads < sms
        splits = {1, default[1]} if short or default[1] > 1 else {1}
        if cfg == default[0] and default[1] > 1:
            splits.add(2 * default[1])
        for n_split in sorted(splits):
            if (cfg, n_split) != default:
                out.append((f"{cfg.block_m}x{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages} split {n_split}",
                            {"cfg": cfg, "n_split": n_split}))
    return out


def measure_launch(launch: Launch, names: list[str], dtype: torch.dtype, device: torch.device,
                   quick: bool, variants: bool = False) -> dict:
    """Per backend: ``attend`` per call (``call_ms``: host work included) and its whole call
    on prepared inputs, merge included (``kernel_ms``); one op call on everything joined
    (``single``, the SDPA backends) and, where cuDNN runs, that call with the fused combine
    (``single_combine``); with ``variants``, triton's candidate configurations and splits and
    cuDNN unsplit (``variants``); milliseconds."""
    qs, kvs = _inputs(launch, dtype, device)
    states = [new_state(q) for q in qs]
    scale = launch.head_dim ** -0.5
    got: dict[str, dict] = {"attend": {}, "kernel": {}, "kernel_how": {}, "single": {}, "single_combine": {},
                            "variants": {}, "errors": {}}
    for name in names:
        try:
            with backend(name):
                ms = call_ms(lambda: attend(qs, kvs, states, scale=scale), device, quick)
            kernel = kernel_ms(_kernel_fn(name, qs, kvs, scale), device, quick)
            single = (kernel_ms(_single_call(name, qs, kvs, scale), device, quick)[0]
                      if name in ("cudnn", "torch", "cpu") else None)
        except Exception as exc:  # noqa: BLE001  (one backend's error costs its figures only)
            got["errors"][name] = f"{type(exc).__name__}: {exc}"[:300]
            continue
        got["attend"][name] = ms
        got["kernel"][name], got["kernel_how"][name] = kernel
        if single is not None:
            got["single"][name] = single
    extra = []
    if "cudnn" in names:
        extra.append(("cudnn single + combine", lambda: _single_with_combine(qs, kvs, scale), "single_combine"))
        if variants:
            extra.append(("cudnn unsplit", lambda: _kernel_fn("cudnn", qs, kvs, scale, kv_splits=1), "variants"))
    if variants and "triton" in names and device.type == "cuda":
        extra += [(f"triton {label}", functools.partial(_kernel_fn, "triton", qs, kvs, scale, **how), "variants")
                  for label, how in triton_variants(launch, device, quick)]
    for label, make, key in extra:
        try:
            got[key][label if key == "variants" else "cudnn"] = kernel_ms(make(), device, quick)[0]
        except Exception as exc:  # noqa: BLE001  (a candidate a GPU refuses costs its figure only)
            got["errors"][label] = f"{type(exc).__name__}: {exc}"[:300]
    return got


def _us(ms: float) -> str:
    return f"{ms * 1e3:.0f} us"


MEETS = 0.9  # of the single cuDNN call's TFLOP/s: the target every launch is held to
SPEED_BUDGET_S = {False: 120.0, True: 70.0}  # of the stage's 180 s: variants stop past it


def _launches(model: ModelShape) -> list[Launch]:
    """The fused launches (the layer's launches to come), then the per-ring-step ones."""
    return [*schedule_launches(model, fused=True), *schedule_launches(model)]


def speed(w: RowWriter, device: torch.device, quick: bool = False) -> None:
    """Every backend that runs here on each launch of a layer, fused and per ring step (bf16):
    ``attend`` per call, the backend's whole call merge included (prepared, replayed in a CUDA
    graph) with TFLOP/s against one cuDNN call over the same tokens (contiguous Q, joined K/V;
    the torch op's where cuDNN does not run) and that call with the fused combine; whether each
    reaches ``MEETS`` of the single call's TFLOP/s; on the fused launches, triton's candidate
    configurations and splits and cuDNN unsplit while ``SPEED_BUDGET_S`` lasts (fewer
    candidates with ``quick``). On CPU: the stand-in launches and backends, to
    exercise the stage. The rows' ``attend_ms`` make the measured kernel table
    (``kernel-table.json``)."""
    dtype = torch.bfloat16
    arch = "cpu"
    if device.type == "cuda":
        arch = arch_key(torch.cuda.get_device_capability(device))
    start = time.monotonic()
    seen: dict[int, list[str]] = {}
    label = lambda n: LABELS.get(n, n)  # noqa: E731
    for model in models(device):
        if model.head_dim not in seen:
            seen[model.head_dim] = runnable(w, device, model.head_dim, dtype)
        names = seen[model.head_dim]
        for launch in _launches(model):
            in_budget = time.monotonic() - start < SPEED_BUDGET_S[quick]
            variants = device.type == "cuda" and in_budget and launch.mode == "fused"
            got = measure_launch(launch, names, dtype, device, quick, variants)
            for name, error in got["errors"].items():
                w.add(f"{launch.name}: {label(name)}", "FAIL", error)
            if not got["attend"]:
                continue
            tf = {n: launch.flops / (ms * 1e-3) / 1e12 for n, ms in got["kernel"].items()}
            ref_name = next((n for n in ("cudnn", "torch", "cpu") if n in got["single"]), None)
            ref_tf = launch.flops / (got["single"][ref_name] * 1e-3) / 1e12 if ref_name else None
            share = {n: t / ref_tf for n, t in tf.items()} if ref_tf else {}
            meets = {n: x >= MEETS for n, x in share.items()}
            best = min(got["attend"], key=got["attend"].get)
            best_variant = min(got["variants"], key=got["variants"].get) if got["variants"] else None
            figure = (f"x{launch.count} per layer; kernels, merge included: "
                      + ", ".join(f"{label(n)} {_us(ms)} ({tf[n]:.0f} TFLOP/s"
                                  + (f", {share[n]:.0%}{'' if meets[n] else ' < 90 %'}" if n in share else "") + ")"
                                  for n, ms in got["kernel"].items())
                      + (f"; one {label(ref_name)} call {_us(got['single'][ref_name])} ({ref_tf:.0f} TFLOP/s)"
                         if ref_name else "")
                      + (f", with the fused combine {_us(got['single_combine']['cudnn'])}"
                         if "cudnn" in got["single_combine"] else "")
                      + "; attend " + ", ".join(f"{label(n)} {_us(ms)}" for n, ms in got["attend"].items())
                      + (f"; best variant {best_variant} {_us(got['variants'][best_variant])}" if best_variant else "")
                      + ("; variants not timed (stage budget)" if device.type == "cuda" and launch.mode == "fused"
                         and not variants else ""))
            choice = None
            if device.type == "cuda" and "triton" in names:
                from ...kernels.triton_attend import launch_choice
                cfg, n_split = launch_choice(device, launch.head_dim, launch.q_lens, launch.kv_lens, launch.heads)
                choice = f"{cfg} split {n_split}"
            w.add(launch.name, "INFO", figure, attend_ms=got["attend"], kernel_ms=got["kernel"],
                  kernel_how=got["kernel_how"], single_ms=got["single"], single_combine_ms=got["single_combine"],
                  tflops=tf, reference=ref_name, reference_tflops=ref_tf, share_of_reference=share,
                  meets_90=meets, variants_ms=got["variants"], best_variant=best_variant, fastest=best,
                  arch=arch, shape=shape_key(launch.head_dim, dtype), config=choice, flops=launch.flops,
                  count=launch.count, mode=launch.mode, launch=launch.__dict__, stand_in=device.type != "cuda")
