"""What the diffusers examples share: the flags besides the pipeline's own, the timed run with
a strategy enabled on the pipeline's transformers, the report, and the launch (torchrun or
emulated CPU ranks). Each ``diffusers_*_example.py`` beside this file loads its pipeline,
generates once and saves its output; this file is the rest."""
from __future__ import annotations

import argparse
import os
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from xfuser_swiftfusion.integrations import diffusers as sfd  # the diffusers integration
from xfuser_swiftfusion.tools.quiet import quiet_libraries, quiet_rank

quiet_libraries()  # before transformers loads: the result lines, not per-rank notices

# (output or None, final latents) of one generation of ``steps`` steps
Generate = Callable[[Any, argparse.Namespace, torch.device, int], tuple[Any, torch.Tensor]]


def parse(p: argparse.ArgumentParser, cpu_defaults: dict, argv: list[str] | None
          ) -> argparse.Namespace:
    """Parse; the text flags every pipeline has; on CPU the tiny model's ``cpu_defaults``."""
    p.add_argument("--guidance_scale", type=float, default=p.get_default("guidance_scale"))
    p.add_argument("--max_sequence_length", type=int, default=512)
    if not torch.cuda.is_available():
        p.set_defaults(**cpu_defaults)
    args = p.parse_args(argv)
    if args.model is None:
        p.error("--model is required on GPUs")
    return args


def parser(description: str, model_help: str) -> argparse.ArgumentParser:
    """The flags every example has; the example adds its pipeline's and calls ``parse``."""
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", default=None if cuda else "tiny", help=model_help)
    p.add_argument("--strategy", default="swiftfusion", help="tas, torus, swiftfusion or auto")
    p.add_argument("--topology", default=None, help="NxM machines x GPUs (default: detected)")
    p.add_argument("--emulate", metavar="NxM", default=None,
                   help="CPU: run on N machines x M GPUs emulated by forked gloo ranks")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--warmup", type=int, default=1, help="untimed generations first")
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=not cuda,
                   help="also run on one device first and report the difference")
    p.add_argument("--save", default=None, help="rank 0 writes the output here")
    return p


def keep_final_latents() -> tuple[Callable, dict]:
    """A ``callback_on_step_end`` that keeps the latents of the last step in ``holder["latents"]``
    (pass ``callback_on_step_end_tensor_inputs=["latents"]``)."""
    holder: dict = {}

    def keep(_pipe, _step, _t, tensors):
        holder["latents"] = tensors["latents"]
        return tensors

    return keep, holder


def device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def timed_run(pipe, transformers: list, generate: Generate, args: argparse.Namespace,
              dev: torch.device) -> dict:
    """Reference (``--check``), then the strategy on every transformer, warm-up, one timed
    generation; the strategy is disabled again. Returns what the report needs."""
    quiet_rank(dist.get_rank())
    reference = generate(pipe, args, dev, args.steps)[1] if args.check else None
    ctxs = [sfd.enable_parallelism(t, strategy=args.strategy, topology=args.topology)
            for t in transformers]
    for _ in range(args.warmup):
        generate(pipe, args, dev, args.steps)
    _sync(dev)
    start = time.perf_counter()
    output, latents = generate(pipe, args, dev, args.steps)
    _sync(dev)
    elapsed = time.perf_counter() - start
    stats = [ctx.stats() for ctx in ctxs]
    for t in transformers:
        sfd.disable_parallelism(t)
    err = None if reference is None else (latents.float() - reference.float()).abs().max().item()
    return {"output": output, "elapsed": elapsed, "stats": stats, "err": err}


def report(what: str, result: dict) -> None:
    """On the last rank: strategy, mesh, latency, attention calls, error vs one device."""
    if dist.get_rank() != dist.get_world_size() - 1:
        return
    stats = result["stats"]
    print(f"{what}, {dist.get_world_size()} ranks: strategy {stats[0]['strategy']}, "
          f"mesh {stats[0]['mesh']}")
    print(f"latency: {result['elapsed']:.3f} s ({sum(s['calls'] for s in stats)} attention calls "
          f"on the strategy, fallbacks {[s['fallbacks'] for s in stats]})")
    if result["err"] is not None:
        print(f"max |latents - single device|: {result['err']:.3e}")


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def launch(run: Callable[[argparse.Namespace], None], args: argparse.Namespace) -> None:
    """``run(args)`` on every torchrun rank, or on ``--emulate NxM`` forked CPU ranks."""
    if "RANK" in os.environ and not args.emulate:
        from xfuser_swiftfusion.distributed import init_distributed_from_env
        init_distributed_from_env()
        try:
            run(args)
        finally:
            dist.destroy_process_group()
        return
    if args.emulate is None:
        raise SystemExit("launch with torchrun, or pass --emulate NxM to emulate ranks on CPU")
    from xfuser_swiftfusion.emulation.launcher import run_emulated
    run_emulated(run, args.emulate, args, timeout_s=1800.0)
