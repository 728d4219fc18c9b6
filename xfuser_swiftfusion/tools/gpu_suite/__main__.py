"""One stage of the GPU suite in this process: ``python -m xfuser_swiftfusion.tools.gpu_suite
STAGE --rows FILE``. The suite (``swiftfusion check --gpu-suite``) starts each stage as such a
process, under a timeout, compute-sanitizer or Nsight Compute where it asks for them."""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from .report import RowWriter

IN_PROCESS = ("env", "numerics", "launches", "one-launch", "speed", "replay", "strategies",
              "nvshmem", "nvshmem-smoke", "compile", "pe-probe", "pe-strategy")


def _device() -> torch.device:
    if torch.cuda.is_available():
        index = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m xfuser_swiftfusion.tools.gpu_suite")
    p.add_argument("stage", choices=IN_PROCESS)
    p.add_argument("--rows", required=True, help="JSON-lines file the rows are appended to")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--launch", help="one-launch: the Launch as JSON")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--label", default="", help="pe-probe: the case name; pe-strategy: plain or MPS")
    p.add_argument("--fault", action="store_true", help="pe-strategy: the run where a PE is killed")
    args = p.parse_args(argv)
    w = RowWriter(args.rows, args.stage)
    from . import kernel, paths, symmetric
    if args.stage == "pe-probe":  # a raw NVSHMEM PE of a world on one GPU
        try:
            got = symmetric.pe_probe(args.rank, args.world, args.port)
            if args.rank == 0:
                w.check(args.label, got["received"] == got["expected"],
                        f"{args.world} PEs on GPU 0: init, put to the next PE, barrier: received "
                        f"{got['received']:g} (expected {got['expected']:g})", **got)
        except Exception as exc:  # noqa: BLE001  (what NVSHMEM refuses is the finding)
            w.add(f"{args.label} (rank {args.rank})", "INFO",
                  f"refused: {type(exc).__name__}: {exc}"[:400])
        return 0
    if args.stage == "pe-strategy":  # one PE of a world on one GPU (or a CPU stand-in)
        from . import pe_strategy
        return pe_strategy.pe(w, args.rank, args.world, args.port, args.label, args.fault)
    if args.stage in ("strategies", "nvshmem", "nvshmem-smoke", "compile"):
        paths.single_process_env()
    device = _device()
    if args.stage in ("nvshmem", "nvshmem-smoke"):
        return _nvshmem(args.stage, w, device)
    if args.stage == "env":
        paths.env(w, device)
    elif args.stage == "numerics":
        kernel.numerics(w, device, args.quick)
    elif args.stage == "launches":
        kernel.launches(w, device)
    elif args.stage == "one-launch":
        spec = json.loads(args.launch)
        spec["q_lens"], spec["kv_lens"] = tuple(spec["q_lens"]), tuple(spec["kv_lens"])
        kernel.run_launch(kernel.Launch(**spec), torch.bfloat16, device)
    elif args.stage == "speed":
        kernel.speed(w, device, args.quick)
    elif args.stage == "replay":
        from . import replay
        replay.replay(w, device, args.quick)
    elif args.stage == "strategies":
        import torch.distributed as dist
        paths.strategies(w, args.quick)
        dist.destroy_process_group()
    elif args.stage == "compile":
        paths.compiled_attention(w, device)
        paths.runner(w, args.quick)
    return 0


def _nvshmem(stage: str, w: RowWriter, device: torch.device) -> int:
    """``nvshmem``: the communicator's checks, then the timeout path (NVSHMEM is left failed on
    purpose: the process leaves without its teardown). ``nvshmem-smoke``: init, a round trip,
    close, and a normal exit, which finalizes NVSHMEM (exit status 1 if any of it failed)."""
    from ...comm.nvshmem import nvshmem_import_error
    from . import symmetric
    if device.type != "cuda":
        w.add("(stage)", "SKIP", "needs a CUDA device")
        return 0 if stage == "nvshmem" else 1
    error = nvshmem_import_error()
    if error is not None and stage == "nvshmem":
        w.add("(stage)", "SKIP", f"nvshmem.core does not import: {error}"[:300])
        return 0
    from ...distributed import init_distributed_from_env
    init_distributed_from_env()
    if stage == "nvshmem-smoke":
        import torch.distributed as dist
        ok = symmetric.smoke(w)
        dist.destroy_process_group()
        print(f"nvshmem smoke test: {'ok' if ok else 'FAILED'} (finalize follows at exit)", flush=True)
        return 0 if ok else 1
    symmetric.lifecycle(w)
    symmetric.timeout_path(w)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
