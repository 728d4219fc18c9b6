"""``swiftfusion calibrate --links p4de|p5|h100-ndr``: this code's costs on one GPU, with the
links of a built-in profile, as a hardware profile file.

One GPU measures what one GPU can, as the GPU suite does (its stages run in this process,
their rows kept beside the profile, ``<out>.rows.jsonl``):

- the speed stage (``gpu_suite/kernel.py``): every backend's kernel on the Torus schedule's
  launch shapes of Flux 3072 / 4096 px and CogVideoX 5B on 4 x 8 GPUs (CUDA graph), and
  ``attend`` called back to back; the same launches again in each other dtype of
  ``--dtypes``;
- the replay stage (``gpu_suite/replay.py``): rank 0's whole ``swiftfusion`` layer of those
  models, transfers as device copies: its GPU time and the host's time to issue it (a sleep
  kernel ahead);
- xFuser's USP compute on rank 0 of the same layers (``usp_rows``): one cuDNN call with
  log-sum-exp per ring step, merged as torch's ring attention merges, timed the same ways;
- a device-to-device copy (the copy rate).

``gpu_costs.derive`` turns the rows into costs exactly as it does a committed run's, and
``hardware.measured_gpu_profile`` puts them beside the named profile's datasheet links. On a
machine without CUDA, ``--allow-cpu`` runs the stages' CPU stand-ins (to try the command: the
figures are the CPU's).
"""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ..hardware import MACHINES, HardwareProfile, host_cpu, measured_gpu_profile
from ..mesh import choose_mesh
from ..strategies.registry import specs
from ..topology import Topology
from . import gpu_costs
from .gpu_suite import kernel, paths
from .gpu_suite.report import RowWriter
from .gpu_suite.timing import host_and_gpu_ms, kernel_ms

COPY_BYTES = {"cuda": 256 << 20, "cpu": 16 << 20}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _device(allow_cpu: bool) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if not allow_cpu:
        raise ValueError("calibrate --links measures one GPU and no CUDA device is visible here "
                         "(--allow-cpu runs the CPU stand-ins, to try the command)")
    return torch.device("cpu")


def _other_dtypes(w: RowWriter, device: torch.device, dtypes: tuple[str, ...], quick: bool) -> None:
    """The speed stage's launches in each dtype of ``dtypes`` besides bf16 (which the stage
    measured): per backend that runs there, the kernel alone and ``attend`` per call."""
    for name in dtypes:
        dtype = DTYPES[name]
        if dtype == torch.bfloat16:
            continue
        for model in kernel.models(device):
            names = kernel.runnable(None, device, model.head_dim, dtype)
            for launch in kernel.torus_launches(model):
                got = kernel.measure_launch(launch, names, dtype, device, quick)
                if not got["kernel"]:
                    continue
                w.add(f"{launch.name} {name}", "INFO", "", attend_ms=got["attend"],
                      kernel_ms=got["kernel"], fastest=min(got["kernel"], key=got["kernel"].get),
                      shape=f"{launch.head_dim}/{name}", flops=launch.flops, launch=launch.__dict__)


def usp_rows(device: torch.device, quick: bool) -> list[dict]:
    """Per model (``kernel.models``): the baseline's compute on rank 0 of its default mesh on
    4 x 8 GPUs (Ulysses x ring degrees of its placement): ``ring`` attention calls of the
    rank's heads over ``L / ring`` queries and keys each (cuDNN with log-sum-exp on CUDA as
    xFuser runs it on Hopper; torch's CPU flash op on CPU), each merged into the running output
    as torch's ring attention merges (``out -= sigmoid(lse_i - lse) * (out - out_i)``,
    ``lse -= logsigmoid(lse - lse_i)``); GPU milliseconds per layer (CUDA graph) and the
    host's (a sleep kernel ahead)."""
    from ..kernels import torch_cuda
    base = next(s for s in specs() if s.baseline)
    topo = Topology(4, 8)
    out = []
    for model in kernel.models(device):
        mesh = choose_mesh(topo, model.heads, base.placement)
        h, R, D = model.heads // mesh.ulysses, mesh.ring, model.head_dim
        n = -(-model.tokens // R)
        gen = torch.Generator(device=device).manual_seed(0)
        make = lambda: torch.randn(1, h, n, D, device=device, generator=gen).to(torch.bfloat16)  # noqa: E731
        q, kvs = make(), [(make(), make()) for _ in range(R)]
        if device.type == "cuda":
            op = torch_cuda.cudnn_op
        else:
            op = lambda q, k, v, s: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, scale=s)[:2]  # noqa: E731

        def layer(q=q, kvs=kvs, op=op, D=D):
            acc = lse = None
            for k, v in kvs:
                o, l = op(q, k, v, D ** -0.5)       # [1, h, n, D], [1, h, n]
                l = l.unsqueeze(-1).float()          # [1, h, n, 1]
                if acc is None:
                    acc, lse = o.float(), l
                else:
                    acc = acc - torch.sigmoid(l - lse) * (acc - o.float())
                    lse = lse - F.logsigmoid(lse - l)
            return acc.to(q.dtype)

        gpu = kernel_ms(layer, device, quick)[0]
        host = host_and_gpu_ms(layer, device, 3 if quick else 5)[0]
        out.append({"model": model.name, "heads": h, "queries": n, "keys": n * R, "head_dim": D,
                    "calls": R, "gpu_ms": gpu, "host_ms": host})
    return out


def copy_rate(device: torch.device, quick: bool) -> float:
    """Bytes/s of one device-to-device copy (CUDA graph)."""
    x = torch.empty(COPY_BYTES[device.type], dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    return x.numel() / (kernel_ms(lambda: y.copy_(x), device, quick)[0] * 1e-3)


def _commit() -> str:
    """The package's git commit where it is a checkout, else its version."""
    here = Path(__file__).resolve().parents[2]
    try:
        res = subprocess.run(["git", "-C", str(here), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10)
        if res.returncode == 0 and res.stdout.strip():
            return res.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    from importlib.metadata import version
    return f"xfuser-swiftfusion {version('xfuser-swiftfusion')}"


def _run(rows: list[dict], rows_path: Path) -> dict:
    """The run the costs come from: this GPU (or CPU), the code's commit, now, versions."""
    env = {r["case"]: r["data"] for r in rows if r["stage"] == "env"}
    gpu, pkgs = env.get("gpu", {}), env.get("packages", {})
    return {"dir": str(rows_path), "gpu": gpu.get("name") or host_cpu(), "sm": gpu.get("sm"),
            "commit": _commit(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "versions": {**{k: pkgs[k] for k in ("torch", "triton") if k in pkgs},
                         "cuda": gpu.get("cuda"), "cudnn": torch.backends.cudnn.version()}}


def measure(rows_path: Path, device: torch.device, dtypes: tuple[str, ...], quick: bool) -> dict:
    """Every measurement (module docstring) into ``rows_path``; the costs derived from them."""
    from .gpu_suite import replay
    if rows_path.exists():
        rows_path.unlink()
    p = str(rows_path)
    paths.env(RowWriter(p, "env"), device)
    kernel.speed(RowWriter(p, "speed"), device, quick)
    _other_dtypes(RowWriter(p, "speed"), device, dtypes, quick)
    replay.replay(RowWriter(p, "replay"), device, quick)
    usp = usp_rows(device, quick)
    RowWriter(p, "usp").add("rank 0 of 4x8", "INFO", "", rows=usp)
    rate = copy_rate(device, quick)
    rows = gpu_costs.load_rows(rows_path)
    baseline = {"how": (f"measured: {base_how(device)}, GPU time from a CUDA graph, host time with a "
                        "sleep kernel ahead; xFuser's collectives' host cost not measured: 0"),
                "rows": usp}
    copy = {"copy_bw": rate, "copy_how": f"one device copy of {COPY_BYTES[device.type] >> 20} MiB (CUDA graph)"}
    return gpu_costs.derive(rows, _run(rows, rows_path), baseline, kernel.models(device), copy)


def base_how(device: torch.device) -> str:
    op = "cuDNN" if device.type == "cuda" else "torch's CPU flash op"
    return (f"the baseline's compute on rank 0 of 4 x 8: one {op} call with log-sum-exp per ring "
            "step, merged as torch's ring attention merges (sigmoid/logsigmoid)")


def calibrate_one_gpu(links: str, out: str, name: str, dtypes: tuple[str, ...], quick: bool,
                      allow_cpu: bool) -> tuple[HardwareProfile, str]:
    """The profile (links of built-in profile ``links``, this GPU's costs) and a table of the
    costs with the replay's check."""
    if links not in MACHINES:
        raise ValueError(f"--links {links!r}: choose one of {', '.join(MACHINES)}")
    bad = [d for d in dtypes if d not in DTYPES]
    if bad:
        raise ValueError(f"--dtypes: unknown {', '.join(bad)}; choose from {', '.join(DTYPES)}")
    device = _device(allow_cpu)
    costs = measure(Path(os.path.splitext(out)[0] + ".rows.jsonl"), device, dtypes, quick)
    prof = measured_gpu_profile(name, MACHINES[links], costs, scale=1.0)
    return prof, format_costs(prof, costs, kernel.models(device))


def format_costs(prof: HardwareProfile, costs: dict, models) -> str:
    """The measured costs, one line each, and the replay check."""
    ours = costs["ours"]
    tf = lambda pts: "-".join(f"{x / 1e12:.3g}" for x in (min(p[2] for p in pts), max(p[2] for p in pts)))  # noqa: E731
    lines = [f"{prof.name}: {prof.source}",
             f"host: attend call {ours['attend_call_s'] * 1e6:.0f} us + {ours['merge_call_s'] * 1e6:.0f} us "
             f"per query chunk, transfer {ours['transfer_call_s'] * 1e6:.0f} us; device: "
             f"{ours['chunk_s'] * 1e6:.1f} us per query chunk, copies {prof.copy_bw / 1e9:.0f} GB/s"]
    for dt, t in prof.attention.items():
        cells = [f"D{D} {tf(pts)}" for D, pts in sorted(t.items())]
        lines.append(f"attention {dt} TFLOP/s over the launch shapes: {', '.join(cells)}")
    base = prof.baseline
    lines.append(f"baseline: {base['attend_call_s'] * 1e6:.0f} us host per call, "
                 + ", ".join(f"D{D} {tf(pts)} TFLOP/s" for D, pts in sorted(base["attention"]["bf16"].items())))
    lines.append(gpu_costs.format_check(gpu_costs.check_replay(costs, models)))
    return "\n".join(lines)


__all__ = ["calibrate_one_gpu", "copy_rate", "format_costs", "measure", "usp_rows"]
