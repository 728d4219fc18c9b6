"""Kernel checks of the GPU suite: numerics against fp64, one launch per configuration (for
compute-sanitizer), speed of the launches the Torus stages make (for Nsight Compute too).

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

from ...kernels import attend, current_backend, new_state, set_backend
from .report import RowWriter

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
def _triton() -> Iterator[None]:
    """Every ``attend`` call inside runs the triton kernel (automatic choice again after)."""
    set_backend("triton")
    try:
        yield
    finally:
        set_backend(None)


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
    results = [numerics_case(device, D, dtype, finalize, s, longest) for s in seeds]
    worst = max(results, key=lambda r: max(r["err"], r["lse_err"]))
    tol = TOLERANCE[dtype]
    ok = all(_passes(r, tol) for r in results)
    w.check(case, ok, f"{worst['backend']}: max err {worst['err']:.2e}, LSE {worst['lse_err']:.2e}, "
            f"rel {worst['rel']:.1e} (tol {tol:g}; {len(results)} chunkings)",
            worst=worst, cases=len(results), tolerance=tol)


def numerics(w: RowWriter, device: torch.device, quick: bool = False) -> None:
    """Triton at D 32/64/128, bf16 and fp16, finalize on and off; then what auto picks for the
    head dims and dtypes the kernel does not take. On CPU (``TRITON_INTERPRET=1``): a small
    subset, to exercise the suite itself."""
    cpu = device.type != "cuda"
    seeds = range(2 if cpu else (4 if quick else 8))
    longest = 40 if cpu else 300
    with _triton():
        for D, dtype, fin in _triton_configs(device):
            _numerics_row(w, f"triton {_case_name(D, dtype, fin)}", device, D, dtype, fin, seeds, longest)
    if cpu:
        return
    for D, dtype in FALLBACK_SHAPES:  # auto's choice for shapes triton does not take
        _numerics_row(w, f"auto D{D} {DTYPE_NAMES[dtype]}", device, D, dtype, True, seeds, longest)


def launches(w: RowWriter, device: torch.device) -> None:
    """One small launch of every triton configuration (D, dtype, finalize, grouped K/V), each
    checked against fp64: the program compute-sanitizer runs."""
    longest = 160 if device.type == "cuda" else 24
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
    """One attention layer of a model: heads, head dim, tokens of the whole sequence."""

    name: str
    heads: int
    head_dim: int
    tokens: int


# Flux 3072 px: (3072/16)^2 = 36864 image tokens + 512 text; 4096 px: 65536 + 512.
# CogVideoX 5B, 49 frames of 720x480: 13 latent frames x 30 x 45 patches = 17550 + 226 text.
MODELS = (ModelShape("Flux 3072px", 24, 128, 36864 + 512),
          ModelShape("Flux 4096px", 24, 128, 65536 + 512),
          ModelShape("CogVideoX-5B", 48, 64, 17550 + 226))


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
    = H' / (T * U) with H' the (padded) head count the strategy runs, S = ceil(L / W)."""
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
    """``repeat`` triton launches of ``launch`` (the program Nsight Compute profiles)."""
    qs, kvs = _inputs(launch, dtype, device)
    states = [new_state(q) for q in qs]
    with _triton():
        for _ in range(repeat):
            attend(qs, kvs, states, scale=launch.head_dim ** -0.5)
    torch.cuda.synchronize()


def speed(w: RowWriter, device: torch.device, quick: bool = False) -> None:
    """TFLOP/s of each Torus launch (bf16): the triton kernel (one launch, states merged) next
    to torch's flash attention on the concatenated K/V (one SDPA call, no merge: the FA2-class
    bound on this GPU) and flash-attn's ``flash_attn_func`` where installed. Medians of
    ``triton.testing.do_bench``."""
    if device.type != "cuda":
        w.add("speed", "SKIP", "needs a CUDA device")
        return
    import importlib.util

    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    from ...kernels.triton_attend import _launch_config
    have_flash = importlib.util.find_spec("flash_attn") is not None
    if not have_flash:
        w.add("flash-attn", "SKIP", "flash_attn is not installed: its column is empty")
    dtype = torch.bfloat16
    bench = lambda fn: do_bench(fn, warmup=10 if quick else 25, rep=40 if quick else 100,  # noqa: E731
                                return_mode="median")
    for model in MODELS:
        for launch in torus_launches(model):
            qs, kvs = _inputs(launch, dtype, device)
            states = [new_state(q) for q in qs]
            scale = launch.head_dim ** -0.5
            q_cat = torch.cat(qs, dim=2)                       # [1, h, sum Lq, D]
            k_cat = torch.cat([k for k, _ in kvs], dim=2)      # [1, h, sum Lk, D]
            v_cat = torch.cat([v for _, v in kvs], dim=2)
            with _triton():
                ms = {"triton": bench(lambda: attend(qs, kvs, states, scale=scale))}
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                ms["torch-flash"] = bench(lambda: torch.nn.functional.scaled_dot_product_attention(
                    q_cat, k_cat, v_cat, scale=scale))
            if have_flash:
                from flash_attn import flash_attn_func
                qb, kb, vb = (x.transpose(1, 2).contiguous() for x in (q_cat, k_cat, v_cat))  # [1, L, h, D]
                ms["flash-attn"] = bench(lambda: flash_attn_func(qb, kb, vb, softmax_scale=scale))
            tflops = {k: launch.flops / (v * 1e-3) / 1e12 for k, v in ms.items()}
            cfg = _launch_config(device, launch.head_dim, launch.q_lens, launch.heads)
            w.add(launch.name, "INFO",
                  ", ".join(f"{k} {tflops[k]:.0f} TFLOP/s ({ms[k] * 1e3:.0f} us)" for k in ms)
                  + f"; triton/torch-flash {ms['torch-flash'] / ms['triton']:.2f}",
                  ms=ms, tflops=tflops, config=str(cfg), launch=launch.__dict__)
