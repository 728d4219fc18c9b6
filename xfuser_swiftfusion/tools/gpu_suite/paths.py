"""The environment, the strategies' and the plugin's CUDA paths: ``swiftfusion check`` rows
on every visible GPU, a compiled model around ``ctx.attention`` and xFuser's runner with
``--use_torch_compile`` (``mode="reduce-overhead"``: inductor's CUDA graphs on a GPU)."""
from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import asdict

import torch
import torch.distributed as dist

from .report import RowWriter

PACKAGES = ("torch", "triton", "numpy", "xfuser", "yunchang", "diffusers", "transformers",
            "nvshmem4py-cu13", "nvidia-nvshmem-cu13", "cuda-core", "cuda-bindings",
            "cuda-pathfinder", "nvidia-cudnn-cu13", "flash-attn", "nvidia-ml-py",
            "xfuser-swiftfusion")


def versions() -> dict[str, str]:
    """Installed version of each of ``PACKAGES`` ("-" where absent)."""
    out = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "-"
    return out


def env(w: RowWriter, device: torch.device) -> None:
    """What ran where: GPU, driver, CUDA, cuDNN, versions, where each package was loaded from,
    whether ``nvshmem.core`` imports and the triton interpreter works (INFO rows)."""
    from ...comm.nvshmem import nvshmem_import_error
    from ...kernels.interpret import interpreter_problem
    v = versions()
    w.add("packages", "INFO", ", ".join(f"{k} {x}" for k, x in v.items()), **v)
    w.add("python", "INFO", f"{platform.python_version()} on {platform.machine()}",
          cpu=platform.processor(), executable=sys.executable, path=sys.path)
    where = {m: _origin(m) for m in ("torch", "triton", "numpy", "cuda.core", "cuda.pathfinder",
                                      "cuda.bindings", "nvshmem", "xfuser", "xfuser_swiftfusion")}
    w.add("loaded from", "INFO", ", ".join(f"{m} {p}" for m, p in where.items()), **where)
    error = nvshmem_import_error()
    w.add("nvshmem.core", "INFO", "imports" if error is None else f"does not import: {error}"[:300],
          error=error)
    problem = interpreter_problem()
    w.add("triton interpreter", "INFO", problem or "usable with this numpy", problem=problem)
    w.add("cudnn", "INFO", f"torch cuDNN {torch.backends.cudnn.version()}"
          if torch.backends.cudnn.is_available() else "torch has no cuDNN",
          version=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None)
    if device.type != "cuda":
        w.add("gpu", "SKIP", "no CUDA device visible")
        return
    p = torch.cuda.get_device_properties(device)
    w.add("gpu", "INFO", f"{p.name}, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, "
          f"{p.total_memory / 2**30:.0f} GiB, {torch.cuda.device_count()} visible, CUDA "
          f"{torch.version.cuda}", name=p.name, sm=f"{p.major}{p.minor}",
          sms=p.multi_processor_count, memory=p.total_memory, count=torch.cuda.device_count(),
          cuda=torch.version.cuda, driver=_driver())
    from ...hwtopo import visible_islands
    found, why = visible_islands()  # what topology detection reads from NVML on this host
    w.add("islands", "INFO", why or found.description, islands=found and found.islands_per_host,
          error=why)


def _origin(module: str) -> str:
    """The folder ``module`` is found in ("-" if it is not found)."""
    import importlib.util
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return "-"
    if spec is None or not spec.origin:
        return "-" if spec is None else str(list(spec.submodule_search_locations or []))
    return os.path.dirname(os.path.dirname(spec.origin))


def _driver() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "-"


USP_FP32_BACKEND = "SDPA_EFFICIENT"  # xFuser's fp32 attention backend with an LSE on CUDA


@contextlib.contextmanager
def xfuser_attention_backend(name: str | None) -> Iterator[None]:
    """xFuser's runtime state picks attention backend ``name`` (as ``--attention_backend name``
    does), for the ``usp`` strategies built inside; None: xFuser's own choice."""
    if name is None:
        yield
        return
    from xfuser.core.distributed import runtime_state as rs
    from xfuser.core.distributed.attention_backend import AttentionBackendType
    chosen = AttentionBackendType[name]
    real = rs.RuntimeState._select_attention_backend
    rs.RuntimeState._select_attention_backend = lambda self, config=None: chosen
    try:
        yield
    finally:
        rs.RuntimeState._select_attention_backend = real


def usp_backend(dtype: str, cuda: bool) -> str | None:
    """xFuser's attention backend for the strategies that run xFuser's own USP (``usp``, and
    ``auto`` where it picks ``usp``) in ``dtype``: on CUDA xFuser picks cuDNN attention, which
    takes fp16/bf16 only, so fp32 runs on ``USP_FP32_BACKEND`` (memory-efficient attention:
    fp32, with an LSE); None: xFuser's own choice. Strategies of this package never build
    xFuser's runtime state, so the choice does not touch them."""
    return USP_FP32_BACKEND if cuda and dtype == "fp32" else None


def _runs_xfuser(strategy: str) -> bool:
    """Whether ``strategy`` runs xFuser's own USP (its spec runs on xFuser's groups)."""
    from ...strategies.registry import get
    return get(strategy).external_groups


def strategies(w: RowWriter, quick: bool = False, cuda: bool | None = None) -> None:
    """Collective (every torchrun rank; rank 0 writes): every strategy against single-device
    attention, bf16 and fp32, with and without replicated text tokens; one row per strategy,
    each strategy in its own try (an error costs its row only: a FAIL, or for fp32 ``usp`` on
    an xFuser backend that cannot run it, a SKIP naming why). ``cuda``: choose xFuser's
    backends as on a GPU (default: whether one is visible)."""
    from ...distributed import init_distributed_from_env
    from ...strategies import names
    from ..check import CheckCase, check_strategy
    init_distributed_from_env()
    world = dist.get_world_size()
    cuda = torch.cuda.is_available() if cuda is None else cuda
    for dtype in ("bf16", "fp32"):
        for joint in ((7,) if quick else (0, 7)):
            case = CheckCase(heads=24, seq_len=1152 if 1152 % world == 0 else 96 * world,
                             head_dim=64, dtype=dtype, joint_tokens=joint)
            for strategy in names():
                label = f"{strategy} {dtype} text {joint} on {world} GPU" + ("s" if world > 1 else "")
                xb = usp_backend(dtype, cuda)
                try:
                    with xfuser_attention_backend(xb):
                        row = check_strategy(strategy, case, timeout_s=60)
                except Exception as exc:  # noqa: BLE001  (a row per strategy; the rest still run)
                    if dist.get_rank() == 0:
                        why = f"{type(exc).__name__}: {exc}"[:300]
                        if xb is not None and _runs_xfuser(strategy):
                            w.add(label, "SKIP", f"xFuser's {xb} backend cannot run fp32 here "
                                  f"(its cuDNN default takes fp16/bf16 only): {why}")
                        else:
                            w.add(label, "FAIL", why)
                    continue
                if dist.get_rank() == 0:
                    on = xb if xb and _runs_xfuser(row.ran_as) else None
                    w.check(label, row.passed,
                            f"ran as {row.ran_as} {row.mesh.split(' ')[0]}"
                            + (f" on xFuser's {on} backend" if on else "")
                            + f": max err {row.max_abs_err:.2e} (tol {row.tolerance:g})",
                            check=asdict(row), xfuser_backend=on)


@torch.no_grad()
def compiled_attention(w: RowWriter, device: torch.device, cuda: bool | None = None) -> None:
    """``torch.compile`` (inductor) of a fp32 model whose attention is ``ctx.attention``, for
    every strategy on this one process: compiled equals eager, a second call compiles nothing,
    one graph break per attention call. xFuser's USP runs on ``usp_backend("fp32", cuda)``
    (``cuda``: as on a GPU; default: whether ``device`` is one)."""
    import torch.nn as nn

    from ... import init_sequence_parallel
    from ...distributed import init_distributed_from_env
    from ...strategies import names
    init_distributed_from_env()
    H, D, S = 4, 64, 256

    class TwoLayers(nn.Module):
        def __init__(self, ctx) -> None:
            super().__init__()
            self.ctx, self.qkv, self.out = ctx, nn.Linear(H * D, 3 * H * D), nn.Linear(H * D, H * D)

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [B, S, H*D]
            # unrolled, attention inlined: a break inside a loop makes Dynamo skip the frame
            q, k, v = self.qkv(x).view(1, S, 3, H, D).permute(2, 0, 3, 1, 4)  # 3 x [B, H, S, D]
            y = self.ctx.attention(q.contiguous(), k.contiguous(), v.contiguous())
            x = x + self.out(y.transpose(1, 2).reshape(1, S, H * D))
            q, k, v = self.qkv(x).view(1, S, 3, H, D).permute(2, 0, 3, 1, 4)
            y = self.ctx.attention(q.contiguous(), k.contiguous(), v.contiguous())
            return torch.tanh(x + self.out(y.transpose(1, 2).reshape(1, S, H * D)))

    xb = usp_backend("fp32", device.type == "cuda" if cuda is None else cuda)
    for strategy in names():
        ctx = None
        # auto builds xFuser's runtime state at its first call: the whole run is inside
        with xfuser_attention_backend(xb):
            try:
                ctx = init_sequence_parallel(strategy, num_heads=H, timeout_s=60)
                torch.manual_seed(0)
                model = TwoLayers(ctx).to(device)
                x = torch.randn(1, S, H * D, device=device)
                torch._dynamo.reset()
                eager = model(x)
                compiled = torch.compile(model)
                first = compiled(x)
                with torch.compiler.set_stance("fail_on_recompile"):
                    second = compiled(x)
                explained = torch._dynamo.explain(model)(x)
                breaks, graphs = explained.graph_break_count, explained.graph_count
                err = max((first - eager).abs().max().item(), (second - eager).abs().max().item())
                w.check(f"torch.compile {strategy}", err <= 1e-5 and (breaks, graphs) == (2, 3),
                        f"compiled vs eager {err:.1e}, {graphs} graphs, {breaks} breaks (one per "
                        "attention call)", err=err, breaks=breaks, graphs=graphs)
            except Exception as exc:  # noqa: BLE001  (a row per strategy; the rest still run)
                w.add(f"torch.compile {strategy}", "FAIL", f"{type(exc).__name__}: {exc}"[:300])
            finally:
                if ctx is not None:
                    ctx.close()


RUNNER_ARGS = dict(height=64, width=64, prompt="a cat", num_inference_steps=2,
                   guidance_scale=3.5, seed=0)  # tiny FLUX.1: 16 image tokens


def _runner_latents(model, text: int) -> torch.Tensor:
    """``xFuserFluxModel._run_pipe`` (runtime-state input parameters, the pipeline call with
    the runner's arguments) with ``max_sequence_length=text``, returning the final latents
    ``[B, S, C]`` instead of images."""
    from xfuser.core.distributed import get_pipeline_parallel_world_size, get_runtime_state
    a = RUNNER_ARGS
    get_runtime_state().set_input_parameters(
        batch_size=1, num_inference_steps=a["num_inference_steps"],
        max_condition_sequence_length=text,
        split_text_embed_in_sp=get_pipeline_parallel_world_size() == 1)
    return model.pipe(height=a["height"], width=a["width"], prompt=a["prompt"],
                      num_inference_steps=a["num_inference_steps"],
                      guidance_scale=a["guidance_scale"], max_sequence_length=text,
                      generator=model._make_generator(a["seed"]), output_type="latent").images


@torch.no_grad()
def runner_compile(strategy: str, text: int, checkpoint: str, topology: str) -> dict:
    """Collective: xFuser's runner path for ``--use_torch_compile --sp-strategy <strategy>``:
    the runner's ``xFuserFluxModel`` with its config (``create_config`` routes the strategy),
    the pipeline in fp32 (the runner loads bf16; fp32 makes compiled vs eager comparable at
    1e-5) on this rank's device, xFuser's runtime state, then xFuser's own ``_compile_model``
    (inductor comm-overlap settings, ``torch.compile(transformer, mode="reduce-overhead")``,
    warm-up through ``_run_pipe``). Returns the compiled-vs-eager error and what Dynamo saw."""
    from diffusers import FluxPipeline
    from xfuser.config import xFuserArgs
    from xfuser.core.distributed import initialize_runtime_state
    from xfuser.model_executor.models.runner_models.flux import xFuserFluxModel
    from xfuser.model_executor.models.transformers.transformer_flux import (
        xFuserFlux1Transformer2DWrapper)

    from ...integrations.xfuser import routing
    config = xFuserArgs(model=checkpoint, use_torch_compile=True, sp_strategy=strategy,
                        topology=topology)
    model = xFuserFluxModel(config)
    model.engine_config, _ = config.create_config()          # routes USP to the strategy
    ctx = routing.routed_context()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    try:
        transformer = xFuserFlux1Transformer2DWrapper.from_pretrained(
            checkpoint, subfolder="transformer", torch_dtype=torch.float32)
        model.pipe = FluxPipeline.from_pretrained(checkpoint, transformer=transformer,
                                                  torch_dtype=torch.float32).to(device)
        initialize_runtime_state(model._get_runtime_state_pipeline(), model.engine_config)
        model.pipe.set_progress_bar_config(disable=True)
        inputs = {}

        def keep_inputs(module, args, kwargs):
            inputs.setdefault("call", (args, kwargs))

        hook = transformer.register_forward_pre_hook(keep_inputs, with_kwargs=True)
        eager = _runner_latents(model, text)
        hook.remove()
        eager_calls = ctx.stats()["calls"]

        torch._dynamo.reset()
        model._compile_model(dict(RUNNER_ARGS, max_sequence_length=text))  # compile, warm up
        compiled_transformer = model.pipe.transformer
        ctx.reset_stats()
        with torch.compiler.set_stance("fail_on_recompile"):  # warm-up compiled every graph
            compiled = _runner_latents(model, text)
        compiled_stats = ctx.stats()
        args, kwargs = inputs["call"]
        explained = torch._dynamo.explain(transformer)(*args, **kwargs)
        return {"err": (compiled.double() - eager.double()).abs().max().item(),
                "scale": eager.abs().max().item(),
                "text_tokens": kwargs["encoder_hidden_states"].shape[1],
                "compiled": isinstance(compiled_transformer,
                                       torch._dynamo.eval_frame.OptimizedModule),
                "mode": model._get_compile_mode(),
                "eager_calls": eager_calls, "calls": compiled_stats["calls"],
                "fallbacks": compiled_stats["fallbacks"],
                "graphs": explained.graph_count, "breaks": explained.graph_break_count,
                "reasons": {str(r.reason).splitlines()[0] for r in explained.break_reasons},
                "break_sites": {f"{r.user_stack[-1].filename}:{r.user_stack[-1].line}"
                                for r in explained.break_reasons},
                "mesh": ctx.mesh.describe(), "device": str(device)}
    finally:
        routing.restore_usp()


def runner(w: RowWriter, quick: bool = False) -> None:
    """Tiny FLUX.1 through xFuser's runner with ``--use_torch_compile`` and each strategy, on
    this one process (``mode="reduce-overhead"`` captures CUDA graphs between the graph breaks
    at the routed attention)."""
    from ...distributed import init_distributed_from_env
    from ...integrations import xfuser as sfx
    from ..models.tiny import tiny_checkpoint
    init_distributed_from_env()
    sfx.install()
    checkpoint = str(tiny_checkpoint("flux"))
    for strategy in (("swiftfusion",) if quick else ("swiftfusion", "torus", "usp")):
        try:
            r = runner_compile(strategy, 29, checkpoint, "1x1")
            ok = (r["compiled"] and r["err"] <= 1e-5 * max(1.0, r["scale"]) and not r["fallbacks"]
                  and r["eager_calls"] == r["calls"] > 0)
            w.check(f"xFuser runner --use_torch_compile {strategy}", ok,
                    f"{r['mode']}: compiled vs eager {r['err']:.1e} (scale {r['scale']:.1f}), "
                    f"{r['calls']} routed calls, {r['breaks']} breaks, fallbacks "
                    f"{r['fallbacks'] or 'none'}", **{k: (sorted(v) if isinstance(v, set) else v)
                                                      for k, v in r.items()})
        except Exception as exc:  # noqa: BLE001
            w.add(f"xFuser runner --use_torch_compile {strategy}", "FAIL",
                  f"{type(exc).__name__}: {exc}"[:300])


def single_process_env() -> None:
    """torchrun's variables for a one-process world, where none are set."""
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "1"),
                 ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(k, v)
    if "MASTER_PORT" not in os.environ:
        from ...emulation.launcher import free_port
        os.environ["MASTER_PORT"] = str(free_port())
