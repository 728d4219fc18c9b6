"""What the example scripts share: xFuser's flags plus ``--emulate``, one timed generation per
rank under a strategy, xFuser's report line, and the launch (torchrun or emulated ranks).

Each ``*_example.py`` beside this file names its pipeline, its CPU sizes, how it shards the
transformer and how it saves the output; this file is the rest, in xFuser's example flow
(load, warm up, time ``num_inference_steps``, print ``epoch time: ...`` on the last rank).
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any, Callable

from xfuser_swiftfusion.tools.quiet import quiet_libraries, quiet_rank

quiet_libraries()  # before xFuser and transformers load: the result lines, not setup notices

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from tqdm import tqdm  # noqa: E402

from xfuser_swiftfusion.distributed import init_distributed_from_env  # noqa: E402
from xfuser_swiftfusion.emulation.launcher import run_emulated  # noqa: E402
from xfuser_swiftfusion.integrations import xfuser as swiftfusion_xfuser  # noqa: E402
from xfuser_swiftfusion.tools.measure import PeakMemory  # noqa: E402
from xfuser_swiftfusion.tools.models.parallel import (  # noqa: E402
    check_shapes, generate_latents, load_pipeline, resolve_model, strategy_session)
from xfuser_swiftfusion.topology import Topology  # noqa: E402

# Before xFuser loads: adds --sp-strategy/--topology to xFuserArgs and lets xFuser run on CPU.
swiftfusion_xfuser.install()

from xfuser import xFuserArgs  # noqa: E402
from xfuser.config import FlexibleArgumentParser  # noqa: E402


def parse_args(description: str, cpu_defaults: dict, argv: list[str] | None = None
               ) -> argparse.Namespace:
    """xFuser's flags plus ``--emulate NxM``; without CUDA, the tiny model at ``cpu_defaults``."""
    parser = FlexibleArgumentParser(description=description)
    xFuserArgs.add_cli_args(parser)
    parser.set_defaults(sp_strategy="swiftfusion")
    parser.add_argument("--emulate", metavar="NxM", default=None,
                        help="CPU: run on N machines x M GPUs emulated by forked gloo ranks")
    parser.add_argument("--hardware", metavar="NAME|PATH", default=None,
                        help="--sp-strategy auto: the cost-model profile, built in or written by "
                             "swiftfusion calibrate (sets $SWIFTFUSION_HARDWARE)")
    if not torch.cuda.is_available():
        model = parser._option_string_actions["--model"]
        model.required, model.default = False, "tiny"
        parser.set_defaults(num_inference_steps=4, max_sequence_length=13, output_type="latent",
                            **cpu_defaults)
    args = parser.parse_args(argv)
    if args.hardware:
        os.environ["SWIFTFUSION_HARDWARE"] = args.hardware  # read by auto on every rank
    return args


def run(kind: str, parallelize: Callable, save: Callable[[Any, str], str], num_frames: int,
        args: argparse.Namespace) -> None:
    """Load ``kind``'s pipeline, shard it with ``parallelize(pipe)`` and time one generation
    on this rank; rank 0 saves a non-latent output with ``save(output, stem)``, the last rank
    reports."""
    rank, world = dist.get_rank(), dist.get_world_size()
    quiet_rank(rank)
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if cuda else "cpu")
    _, path = resolve_model(args.model, kind)

    memory = PeakMemory().start()
    pipe = load_pipeline(path, kind, torch.bfloat16 if cuda else torch.float32, device)
    parameter_memory = memory.stop()

    prompt = " ".join(args.prompt) if isinstance(args.prompt, list) else args.prompt
    gen = dict(prompt=prompt or "a photo of a cat", height=args.height, width=args.width,
               num_frames=num_frames, seed=args.seed, guidance_scale=args.guidance_scale,
               max_sequence_length=args.max_sequence_length)
    # Both degrees left at 1: the strategy chooses the mesh; otherwise they are honoured.
    degrees = (args.ulysses_degree, args.ring_degree)
    ulysses, ring = (None, None) if degrees == (1, 1) else degrees
    heads = pipe.transformer.config.num_attention_heads

    with strategy_session(args.sp_strategy, heads, args.topology, ulysses, ring) as ctx:
        parallelize(pipe)
        if args.warmup_steps > 0:
            generate_latents(pipe, kind, steps=args.warmup_steps, **gen)
        bar = tqdm(total=args.num_inference_steps, desc=f"{kind} {ctx.strategy}", disable=rank != 0)
        memory = PeakMemory().start()
        start = time.time()
        output = generate_latents(pipe, kind, steps=args.num_inference_steps,
                                  on_step=lambda _i: bar.update(1),
                                  output_type=args.output_type, **gen)
        elapsed = time.time() - start
        peak_memory = memory.stop()
        bar.close()
        strategy, mesh = ctx.strategy, ctx.mesh.describe()

    if args.output_type != "latent" and rank == 0:
        Path("results").mkdir(exist_ok=True)
        filename = save(output[0], f"results/{kind}_{strategy}_{world}gpu_{args.width}x{args.height}")
        print(f"output saved to {filename}")
    if rank == world - 1:
        print(f"strategy: {strategy}, mesh {mesh}, world {world}")
        print(f"epoch time: {elapsed:.2f} sec, parameter memory: {parameter_memory / 1e9:.2f} GB, "
              f"memory: {peak_memory / 1e9:.2f} GB")


def launch(kind: str, run_rank: Callable[[argparse.Namespace], None],
           args: argparse.Namespace) -> None:
    """``run_rank(args)`` on every torchrun rank, or on ``--emulate NxM`` forked CPU ranks
    (default 1x1)."""
    if "RANK" in os.environ and not args.emulate:
        init_distributed_from_env()
        try:
            run_rank(args)
        finally:
            dist.destroy_process_group()
        return
    topology = Topology.parse(args.emulate or "1x1")
    _, path = resolve_model(args.model, kind)  # builds the tiny checkpoint once, before forking
    check_shapes(kind, path, args.height, args.width, topology.world_size, args.num_frames)
    run_emulated(run_rank, topology, args, timeout_s=1800.0)
