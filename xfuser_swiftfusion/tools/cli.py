"""The ``swiftfusion`` command: ``plan``, ``calibrate``, ``check``, ``compare`` and
``compare-diffusers``.

- ``swiftfusion plan``: mesh, inter-machine bytes and the predicted latency per layer (with
  its GPU and host time) of every strategy on a cluster shape, and what ``auto`` picks.
- ``swiftfusion calibrate``: this cluster's rates, measured, as a hardware profile file
  (``calibrate.py``) for ``--hardware PATH`` / ``SWIFTFUSION_HARDWARE=PATH``.
- ``swiftfusion check``: every strategy against single-device attention, on the current
  world (under torchrun) or on an emulated ``--emulate NxM`` cluster of CPU processes.
- ``swiftfusion compare``: a model under every strategy through xFuser (``compare.py``), or
  with ``--engine sglang`` SGLang's Flux model class under SGLang's USP and ours
  (``compare_sglang.py``).
- ``swiftfusion compare-diffusers``: a diffusers pipeline under diffusers' own context
  parallelism and under our strategies (``compare_diffusers.py``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, replace

import torch

from ..distributed import init_distributed_from_env
from ..hardware import HARDWARE_ENV
from ..emulation.netns import add_link_argument, link_from_args
from ..kernels import BACKENDS
from ..mesh import (choose_mesh, counted_inter_node_elements, paper_inter_node_elements_per_machine,
                    torus_mesh)
from ..strategies import names
from ..strategies.registry import modelled
from ..topology import Topology, TopologyError

BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def plan(nodes: int, gpus_per_node: int, heads: int, seq_len: int, head_dim: int,
         batch: int = 1, dtype: str = "bf16", hardware: str = "p4de",
         pad_heads: bool = True, kv_pieces: int | None = None) -> dict[str, dict]:
    """Per strategy, as ``init_sequence_parallel`` runs it at the default degree: the
    strategy that runs, its heads (``heads`` > H: zero-padded for the Torus schedule, unless
    ``pad_heads=False``), degrees, inter-machine bytes per GPU and predicted latency per
    attention layer on ``hardware`` (a built-in profile's name or a profile file), with the
    slowest rank's GPU compute and host issue time beside it; ``"recommended"``: the
    (strategy, degrees) ``auto`` would pick, and where that is the baseline, why. Where the
    profile has the rates of finer cuts (``levels``: NVLink pairs inside a socket's island)
    the table is the default cut's and the pick the fastest over every cut (its
    ``topology``; ``cuts``: each cut's own pick). ``kv_pieces``: the K/V pieces P of the strategies
    that take it (torus, swiftfusion), in the table and the candidates; None: each row and
    candidate at the P the model predicts fastest (``cost_model.piece_options``; ties to
    fewer pieces), the row's ``kv_pieces``."""
    from ..cost_model import (Workload, get_profile, host_topologies, piece_options, predict,
                              recommend_cut, refused, why_baseline)
    work = Workload(batch, seq_len, heads, head_dim, dtype)
    profile = get_profile(hardware, Topology(nodes, gpus_per_node))
    options = host_topologies(nodes, gpus_per_node, profile)  # one box: its islands are the machines
    topo = options[0][0]
    out = {}
    for spec in modelled():
        name = spec.name
        mesh, h = (torus_mesh(topo, heads, spec.placement, pad=pad_heads) if spec.needs_torus
                   else (choose_mesh(topo, heads, spec.placement), heads))
        runs = spec.resolve(mesh, log=False)
        per_rank = counted_inter_node_elements(mesh, batch, seq_len, h, head_dim, runs.ring)
        paper = paper_inter_node_elements_per_machine(
            spec.placement, topo.nodes, topo.gpus_per_node, mesh.ulysses,
            batch, seq_len, h, head_dim) / topo.gpus_per_node
        preds = [predict(name, topo, work, profile, pad_heads=pad_heads, options=o)
                 for o in piece_options(runs, mesh, replace(work, heads=h), kv_pieces)]
        pred = min(preds, key=lambda p: (round(p.latency_s / preds[0].latency_s, 3), p.pieces))
        why_not = refused(spec, profile)
        out[name] = {
            "runs_as": "refused" if why_not else runs.name, "heads": h, "refused": why_not,
            "ulysses_degree": mesh.ulysses, "ring_degree": mesh.ring,
            "torus_degree": mesh.torus, "ulysses_intra_degree": mesh.ulysses_intra,
            "inter_node_bytes_per_gpu": sum(per_rank) * BYTES[dtype] // len(per_rank),
            "inter_node_bytes_per_gpu_max": max(per_rank) * BYTES[dtype],
            "paper_inter_node_bytes_per_gpu": paper * BYTES[dtype],
            "predicted_latency_s": pred.latency_s, "predicted_gpu_s": pred.compute_s,
            "predicted_host_s": pred.host_s, "kv_pieces": pred.pieces,
        }
    i, picks, per_cut = recommend_cut(options, work, kv_pieces=kv_pieces)
    (chosen, prof), cands, best = options[i], per_cut[i], picks[i]
    cuts = []
    for (t, pr), b in zip(options, picks):
        cuts.append({"topology": str(t), "hardware": pr.name, "strategy": b.strategy, "label": b.label,
                     "ulysses_degree": b.ulysses, "ring_degree": b.ring,
                     "predicted_latency_s": b.latency_s})
    out["recommended"] = {"strategy": best.strategy, "kv_pieces": best.pieces, "label": best.label,
                          "options": dict(best.options), "ulysses_degree": best.ulysses,
                          "ring_degree": best.ring, "predicted_latency_s": best.latency_s,
                          "hardware": profile.name, "costs": profile.origin(),
                          "why": why_baseline(best, cands, prof), "topology": str(chosen),
                          "islands": chosen.nodes if profile.island_gpus else None, "cuts": cuts,
                          "candidates": [{"strategy": c.strategy, "label": c.label,
                                          "kv_pieces": c.pieces, "ulysses_degree": c.ulysses,
                                          "ring_degree": c.ring, "heads": c.heads,
                                          "predicted_latency_s": c.latency_s}
                                         for c in sorted(cands, key=lambda c: c.latency_s)]}
    return out


def _print_plan(p: dict[str, dict], args) -> None:
    rec = p["recommended"]
    first = rec["cuts"][0]["topology"]   # the table's cut
    where = (f"1 host of {args.gpus_per_node} GPUs in {first.split('x')[0]} islands "
             f"({first}: islands x GPUs, the islands' links as inter-machine)"
             if rec["islands"] else f"{args.nodes} machines x {args.gpus_per_node} GPUs")
    print(f"{where}, H={args.heads} L={args.seq_len} "
          f"D={args.head_dim} B={args.batch} {args.dtype}: inter-machine bytes per GPU and the "
          f"predicted time per layer on profile {rec['hardware']} ({rec['costs']}); GPU: the "
          "slowest rank's compute, host: its time to issue the layer's calls; P: the last "
          "Pull-KV stage's K/V pieces (kv_pieces)")
    print(f"{'strategy':<12} {'runs as':<12} {'heads':>8} {'ulysses':>7} {'ring':>5} {'torus':>6} {'P':>2} "
          f"{'inter-node MB/GPU':>18} {'paper formula':>14} {'predicted ms':>13} {'GPU ms':>8} "
          f"{'host ms':>8}")
    padded, refusals = [], []
    for name, r in p.items():
        if name != "recommended":
            if r.get("refused"):
                refusals.append(r["refused"])
            heads = str(args.heads) if r["heads"] == args.heads else f"{args.heads}->{r['heads']}"
            if r["heads"] != args.heads:
                padded.append(f"{name} ({args.heads}->{r['heads']})")
            print(f"{name:<12} {r['runs_as']:<12} {heads:>8} {r['ulysses_degree']:>7} {r['ring_degree']:>5} "
                  f"{r['torus_degree']:>6} {r['kv_pieces']:>2} {r['inter_node_bytes_per_gpu'] / 1e6:>18.2f} "
                  f"{r['paper_inter_node_bytes_per_gpu'] / 1e6:>14.2f} "
                  f"{r['predicted_latency_s'] * 1e3:>13.3f} {r['predicted_gpu_s'] * 1e3:>8.3f} "
                  f"{r['predicted_host_s'] * 1e3:>8.3f}")
    for why in refusals:
        print(f"refused: {why}")
    if rec["islands"]:
        splits = ", ".join(f"{c['label']} U{c['ulysses_degree']}xR{c['ring_degree']} "
                           f"{c['predicted_latency_s'] * 1e3:.3f}" for c in rec["candidates"])
        print(f"auto's candidates on {rec['topology']}, fastest first (ms per layer): {splits}")
    if len(rec["cuts"]) > 1:
        print("levels compete (the table above is the first cut's): " + "; ".join(
            f"{c['topology']} on {c['hardware']}: {c['label']} U{c['ulysses_degree']}xR"
            f"{c['ring_degree']} {c['predicted_latency_s'] * 1e3:.3f} ms" for c in rec["cuts"])
              + f"; auto plans on {rec['topology']}")
    print(f"recommended (auto): {rec['label']} U{rec['ulysses_degree']}xR{rec['ring_degree']}"
          f"{' on ' + rec['topology'] if len(rec['cuts']) > 1 else ''}, "
          f"{rec['predicted_latency_s'] * 1e3:.3f} ms per layer (a prediction)")
    if rec["why"]:
        print(f"why: {rec['why']}")
    if padded:
        print(f"zero-padded heads so the Torus schedule runs: {', '.join(padded)}; compute and "
              "bytes above are the padded run's (--no-pad-heads: the fallback instead)")


def _check_main(strategies, case, topology, timeout_s):
    """Runs on every rank (torchrun or emulated)."""
    from .check import run_checks
    return [asdict(r) for r in run_checks(strategies, case, topology, timeout_s)]


def _cmd_check(args) -> int:
    from .check import CheckCase, CheckRow, format_table
    if args.gpu_suite:
        from .gpu_suite import STAGES, run_suite
        stages = tuple(s.strip() for s in args.stages.split(",") if s.strip()) if args.stages else STAGES
        return run_suite(args.out, stages, args.quick, args.budget, args.allow_cpu)
    strategies = [s.strip() for s in (args.strategies or ",".join(names())).split(",") if s.strip()]
    bad = [s for s in strategies if s not in names()]
    if bad:
        print(f"error: unknown strategy {', '.join(bad)}; choose from {', '.join(names())}",
              file=sys.stderr)
        return 2
    if args.kernel:
        from ..kernels.dispatch import select_backend
        device = torch.device("cuda" if torch.cuda.is_available() and not args.emulate else "cpu")
        try:  # refuse here, before any rank starts
            select_backend(device, args.kernel)
        except RuntimeError as exc:
            print(f"error: --kernel {args.kernel}: {exc}", file=sys.stderr)
            return 2
        os.environ["SWIFTFUSION_KERNEL"] = args.kernel
    case = CheckCase(args.heads, args.seq_len, args.head_dim, args.batch, args.dtype,
                     args.joint_tokens, args.joint_strategy, args.seed)
    if args.emulate:
        from ..emulation.launcher import run_emulated
        topo = Topology.parse(args.emulate)
        if case.seq_len % topo.world_size:
            print(f"error: --seq-len {case.seq_len} is not divisible by the {topo.world_size} "
                  f"ranks of --emulate {topo}", file=sys.stderr)
            return 2
        rows = run_emulated(_check_main, topo, strategies, case, None, args.timeout,
                            timeout_s=max(120.0, 4 * args.timeout * len(strategies)),
                            link=link_from_args(args))[0]
    else:
        import torch.distributed as dist
        try:
            init_distributed_from_env()
        except RuntimeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        rows = _check_main(strategies, case, args.topology, args.timeout)
        if dist.get_rank() != 0:
            return 0 if all(r["passed"] for r in rows) else 1
    rows = [CheckRow(**r) for r in rows]
    print(f"check: H={case.heads} L={case.seq_len} D={case.head_dim} B={case.batch} {case.dtype}"
          + (f" joint={case.joint_tokens} {case.joint_strategy}" if case.joint_tokens else "")
          + (f" on emulated {args.emulate}" if args.emulate else "")
          + (f" over {args.link_mbit:g} Mbit/s links" if args.emulate and args.link_mbit else ""))
    print(format_table(rows))
    return 0 if all(r.passed for r in rows) else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="swiftfusion", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    # flags of the subcommands that run on a cluster (real or emulated)
    ranks = argparse.ArgumentParser(add_help=False)
    ranks.add_argument("--emulate", metavar="NxM", help="run on N*M forked CPU ranks (gloo)")
    add_link_argument(ranks)
    ranks.add_argument("--topology", metavar="NxM",
                       help="override detected machines x GPUs (torchrun)")
    # ... and run strategies there (auto picks with the --hardware profile)
    cluster = argparse.ArgumentParser(add_help=False, parents=[ranks])
    cluster.add_argument("--strategies", default=None,
                         help="comma-separated (default: every strategy)")
    cluster.add_argument("--seed", type=int, default=0)
    cluster.add_argument("--hardware", default=None, metavar="NAME|PATH",
                         help=f"auto's cost-model profile: a built-in one or a file written by "
                              f"swiftfusion calibrate (sets ${HARDWARE_ENV})")

    pl = sub.add_parser("plan", help="mesh and inter-machine bytes per strategy")
    pl.add_argument("--nodes", type=int, required=True)
    pl.add_argument("--gpus-per-node", type=int, required=True)
    pl.add_argument("--heads", type=int, required=True)
    pl.add_argument("--seq-len", type=int, required=True)
    pl.add_argument("--head-dim", type=int, required=True)
    pl.add_argument("--batch", type=int, default=1)
    pl.add_argument("--dtype", choices=sorted(BYTES), default="bf16")
    pl.add_argument("--json", action="store_true", help="print one JSON object keyed by strategy")
    pl.add_argument("--hardware", default=os.environ.get(HARDWARE_ENV, "p4de"), metavar="NAME|PATH",
                    help="cost-model profile: p4de, p5, h100-ndr (datasheet links, this code's "
                         "measured GPU costs), their -datasheet twins, cpu-emulated, or a file "
                         f"written by swiftfusion calibrate (default ${HARDWARE_ENV}, else p4de)")
    pl.add_argument("--no-pad-heads", dest="pad_heads", action="store_false",
                    help="torus/swiftfusion: the fallback where the default mesh does not fit the "
                         "machines, instead of zero-padded heads (options={'pad_heads': False})")
    pl.add_argument("--kv-pieces", type=int, default=None, metavar="P",
                    help="torus, swiftfusion: the last Pull-KV stage's K/V in P pieces "
                         "(options={'kv_pieces': P}); default: the P of 1, 2, 4 predicted fastest")

    from .calibrate import add_arguments as add_calibrate_arguments
    add_calibrate_arguments(sub.add_parser(
        "calibrate", parents=[ranks],
        help="measure this cluster's transfer, barrier, attention and host rates; write a "
             "hardware profile for --hardware / $" + HARDWARE_ENV))

    ck = sub.add_parser("check", parents=[cluster],
                        help="validate every strategy against single-device attention")
    ck.add_argument("--heads", type=int, default=24)
    ck.add_argument("--seq-len", type=int, default=1152, help="global image tokens")
    ck.add_argument("--head-dim", type=int, default=64)
    ck.add_argument("--batch", type=int, default=1)
    ck.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32")
    ck.add_argument("--joint-tokens", type=int, default=0, help="replicated text tokens")
    ck.add_argument("--joint-strategy", choices=("front", "rear"), default="front")
    ck.add_argument("--timeout", type=float, default=60.0, help="per-wait timeout in seconds")
    ck.add_argument("--kernel", choices=("auto", *BACKENDS),
                    help="local attention kernel (default: per call, triton where it supports "
                         "the head dim and dtype, else flash-attn, else torch; cpu on CPU)")
    gs = ck.add_argument_group("GPU suite (one CUDA machine; see docs/gpu-suite.md)")
    gs.add_argument("--gpu-suite", action="store_true",
                    help="kernel numerics and speed, compute-sanitizer, Nsight Compute, NVSHMEM, "
                         "every strategy and xFuser's runner under torch.compile on this machine's "
                         "GPUs: a pass/fail table with the figures")
    gs.add_argument("--out", default="gpu-suite", help="folder for the table, rows and log")
    gs.add_argument("--quick", action="store_true", help="fewer random cases and strategies")
    gs.add_argument("--stages", help="comma-separated subset of the stages (default: all)")
    gs.add_argument("--budget", type=float, default=540.0,
                    help="seconds for the whole suite; stages that no longer fit are skipped")
    gs.add_argument("--allow-cpu", action="store_true",
                    help="run what can run without a GPU (the triton interpreter), to try the suite")

    from .compare import add_arguments as add_compare_arguments
    cp = sub.add_parser(
        "compare", parents=[cluster],
        help="run a model under every strategy: latency, bytes, memory, error")
    add_compare_arguments(cp)
    cp.add_argument("--engine", choices=("xfuser", "sglang"), default="xfuser",
                    help="xfuser: the model through xFuser, its USP beside ours; sglang: SGLang's "
                         "own Flux model class, its USP at every Ulysses x Ring split beside ours "
                         "(rows: sglang, sglang:U2xR2, tas, ...)")
    cd = sub.add_parser(
        "compare-diffusers", parents=[cluster],
        help="a diffusers pipeline under diffusers' own context parallelism (ulysses, ring, "
             "unified) and under our strategies through the diffusers integration")
    add_compare_arguments(cd)
    from .compare_diffusers import TEXT_TOKENS, add_arguments as add_diffusers_arguments
    add_diffusers_arguments(cd)
    cd.set_defaults(max_sequence_length=TEXT_TOKENS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd != "plan":  # the table is the output
        from .quiet import quiet_libraries
        quiet_libraries()
    had_group = torch.distributed.is_available() and torch.distributed.is_initialized()
    try:
        if getattr(args, "hardware", None) and args.cmd != "plan":
            from ..hardware import get_profile
            get_profile(args.hardware)  # refuse a bad name or file before any rank starts
            os.environ[HARDWARE_ENV] = args.hardware  # auto reads it on every rank (forked or not)
        if args.cmd == "calibrate":
            from .calibrate import cmd_calibrate
            return cmd_calibrate(args)
        if args.cmd == "plan":
            p = plan(args.nodes, args.gpus_per_node, args.heads, args.seq_len, args.head_dim,
                     args.batch, args.dtype, args.hardware, args.pad_heads, args.kv_pieces)
            print(json.dumps(p, indent=2)) if args.json else _print_plan(p, args)
            return 0
        if args.cmd == "compare":
            if args.engine == "sglang":
                from .compare_sglang import cmd_compare_sglang
                return cmd_compare_sglang(args)
            from .compare import cmd_compare
            return cmd_compare(args)
        if args.cmd == "compare-diffusers":
            from .compare_diffusers import cmd_compare_diffusers
            return cmd_compare_diffusers(args)
        return _cmd_check(args)
    except (TopologyError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        if not had_group:
            _leave_process_group()


def _leave_process_group() -> None:
    """Under torchrun: the process group the command created is destroyed before the rank
    exits (a gloo or NCCL group left to interpreter teardown can abort a rank: "terminate
    called without an active exception"); a barrier first when every rank got here, so none
    leaves while a peer still talks to it."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        if sys.exc_info()[0] is None:
            dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
