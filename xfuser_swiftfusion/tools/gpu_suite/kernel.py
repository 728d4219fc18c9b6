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
import math
import random
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
                  longest: int = 300, batch: int = 2, heads: int = 4) -> dict:
    """One random chunking in two launches that carry the running state: errors of the output
    and the LSE against ``reference`` (the output is acc / l of the state when not
    finalizing). Grouped-query K/V (half the heads) on odd seeds."""
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
    attend(qs, kvs[:split], states, scale=scale)
    if finalize:
        outs = [torch.full(q.shape, float("nan"), dtype=dtype, device=device) for q in qs]
        attend(qs, kvs[split:], states, scale=scale, finalize=True, out=outs)
    else:
        attend(qs, kvs[split:], states, scale=scale)
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
                  finalize: bool, seeds: range, longest: int) -> None:
    try:
        results = [numerics_case(device, D, dtype, finalize, s, longest) for s in seeds]
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
    """Triton at D 32/64/128, bf16 and fp16, finalize on and off; cuDNN's attention (its LSE
    layout and units) at D 64/128; then what auto picks for the head dims and dtypes the kernel
    does not take. On CPU (``TRITON_INTERPRET=1``): a small subset, to exercise the suite
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
    """One small launch of every triton configuration (D, dtype, finalize, grouped K/V), each
    checked against fp64: the program compute-sanitizer runs."""
    longest = 160 if device.type == "cuda" else 24
    why = cannot_run("triton", device, 64, torch.bfloat16)
    if why is not None:
        w.add("triton", "SKIP", why)
        return
    with _triton():
        for D, dtype, fin in _triton_configs(device):
            for seed in (0, 1):  # seed 1: grouped K/V
                r = numerics_case(device, D, dtype, fin, seed, longest, batch=1, heads=2)
                w.check(f"launch {_case_name(D, dtype, fin)}{' gqa' if r['heads_kv'] == 1 else ''}",
                        _passes(r, TOLERANCE[dtype]), f"err {r['err']:.1e}", **r)
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
    """One fused launch: Q chunks and K/V chunks of ``heads`` heads, [1, heads, L, D] each."""

    name: str
    heads: int
    head_dim: int
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]

    @property
    def flops(self) -> float:
        """Non-causal attention: 4 * H * sum(Lq) * sum(Lk) * D (two matmuls)."""
        return 4.0 * self.heads * sum(self.q_lens) * sum(self.kv_lens) * self.head_dim


def torus_launches(model: ModelShape, nodes: int = 4, gpus_per_node: int = 8) -> list[Launch]:
    """The distinct launches one GPU makes in a layer of ``swiftfusion`` on ``nodes`` x
    ``gpus_per_node``: every ``attend`` step of ``torus_schedule`` over a machine's K/V block
    is a ring attention of R launches, each of ``n * U`` Q chunks (the step's ``n`` query
    entries, U chunks ``[B, h, S, D]`` each) against the U K/V chunks of one ring step; ``h``
    = H' / (T * U) with H' the (padded) head count the strategy runs, S = ceil(L / W) over all
    ``tokens`` (text in the sequence)."""
    from ...mesh import torus_mesh
    from ...strategies.torus import TEXT, torus_schedule
    from ...topology import Topology
    topo = Topology(nodes, gpus_per_node)
    mesh, heads = torus_mesh(topo, model.heads)
    T, U = mesh.torus, mesh.ulysses_intra
    h, S = heads // (T * U), -(-model.tokens // topo.world_size)
    entries = sorted({len(s.q) for s in torus_schedule(T, 0, False) if s.kind == "attend" and s.kv != TEXT})
    return [Launch(f"{model.name} {topo}: {n * U}Q x {U}KV of {S}, h{h}", h, model.head_dim,
                   (S,) * (n * U), (S,) * U) for n in entries]


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
    """The attention ops backend ``name`` launches for one call, on inputs joined once (no
    merge): one call per Q chunk against the concatenated K/V."""
    from ...kernels import torch_cuda
    from ...kernels.flash import _blhd
    if name == "flash":  # as the flash backend: K/V joined in flash-attn's [B, L, H, D]
        from flash_attn import flash_attn_func
        kb, vb = _blhd([k for k, _ in kvs]), _blhd([v for _, v in kvs])
        return lambda: [flash_attn_func(q.transpose(1, 2), kb, vb, softmax_scale=scale) for q in qs]
    k = torch.cat([k for k, _ in kvs], dim=2)  # [1, h, sum Lk, D]
    v = torch.cat([v for _, v in kvs], dim=2)
    if name == "cpu":
        op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        return lambda: [op(q, k, v, scale=scale) for q in qs]
    op = torch_cuda.cudnn_op if name == "cudnn" else torch_cuda.cuda_op(qs[0])
    return lambda: [op(q, k, v, scale) for q in qs]


def _kernel_fn(name: str, qs, kvs, scale: float):
    if name == "triton":
        from ...kernels.triton_attend import prepare_triton
        return prepare_triton(qs, kvs, [new_state(q) for q in qs], scale)
    return _op_calls(name, qs, kvs, scale)


def _single_call(name: str, qs, kvs, scale: float):
    """One op call on every Q chunk and every K/V chunk concatenated (no merge): the bound a
    single kernel sets for the launch."""
    return _op_calls(name, [torch.cat(qs, dim=2)], kvs, scale)


def measure_launch(launch: Launch, names: list[str], dtype: torch.dtype, device: torch.device,
                   quick: bool) -> dict:
    """Per backend: ``attend`` per call (``call_ms``: host work included), its kernels alone on
    prepared inputs (``kernel_ms``) and, for the SDPA backends, one call on everything
    concatenated; milliseconds."""
    qs, kvs = _inputs(launch, dtype, device)
    states = [new_state(q) for q in qs]
    scale = launch.head_dim ** -0.5
    got: dict[str, dict] = {"attend": {}, "kernel": {}, "kernel_how": {}, "single": {}, "errors": {}}
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
    return got


def _us(ms: float) -> str:
    return f"{ms * 1e3:.0f} us"


def speed(w: RowWriter, device: torch.device, quick: bool = False) -> None:
    """Every backend that runs here on each Torus launch (bf16): ``attend`` per call, the
    kernels alone (prebuilt triton launch; the SDPA ops on prepared inputs) with TFLOP/s, and
    one SDPA call on everything concatenated (the single-kernel bound). On CPU: the stand-in
    launches and backends, to exercise the stage. The rows' ``attend_ms`` make the measured
    kernel table (``kernel-table.json``)."""
    dtype = torch.bfloat16
    arch = "cpu"
    if device.type == "cuda":
        arch = arch_key(torch.cuda.get_device_capability(device))
    seen: dict[int, list[str]] = {}
    for model in models(device):
        if model.head_dim not in seen:
            seen[model.head_dim] = runnable(w, device, model.head_dim, dtype)
        names = seen[model.head_dim]
        for launch in torus_launches(model):
            got = measure_launch(launch, names, dtype, device, quick)
            for name, error in got["errors"].items():
                w.add(f"{launch.name}: {LABELS.get(name, name)}", "FAIL", error)
            if not got["attend"]:
                continue
            tf = {n: launch.flops / (ms * 1e-3) / 1e12 for n, ms in got["kernel"].items()}
            best = min(got["attend"], key=got["attend"].get)
            label = lambda n: LABELS.get(n, n)  # noqa: E731
            figure = ("attend " + ", ".join(f"{label(n)} {_us(ms)}" for n, ms in got["attend"].items())
                      + "; kernels " + ", ".join(f"{label(n)} {_us(ms)} ({tf[n]:.0f} TFLOP/s)"
                                                 for n, ms in got["kernel"].items())
                      + ("; one call " + ", ".join(f"{label(n)} {_us(ms)}" for n, ms in got["single"].items())
                         if got["single"] else "")
                      + f"; fastest attend: {label(best)}")
            cfg = None
            if device.type == "cuda" and "triton" in names:
                from ...kernels.triton_attend import _launch_config
                cfg = str(_launch_config(device, launch.head_dim, launch.q_lens, launch.heads))
            w.add(launch.name, "INFO", figure, attend_ms=got["attend"], kernel_ms=got["kernel"],
                  kernel_how=got["kernel_how"], single_ms=got["single"], tflops=tf, fastest=best,
                  arch=arch, shape=shape_key(launch.head_dim, dtype), config=cfg,
                  flops=launch.flops, launch=launch.__dict__, stand_in=device.type != "cuda")
