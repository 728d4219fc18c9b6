"""torchrun's environment -> the default process group and this rank's device."""
from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist


def init_distributed_from_env(timeout_s: float | None = None) -> torch.device:
    """Join the default process group from torchrun's variables (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``...): NCCL with CUDA, else gloo. With CUDA the rank's device is
    ``LOCAL_RANK``'s GPU, set before any NCCL or NVSHMEM call, and NCCL initialises eagerly
    on it. Returns the device (CPU without CUDA); a no-op for the group if it exists."""
    if not dist.is_initialized() and "RANK" not in os.environ:
        raise RuntimeError("not launched by torchrun (no RANK in the environment): use "
                           "torchrun --nnodes=N --nproc_per_node=M ..., or --emulate NxM to run "
                           "on emulated CPU ranks")
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        kwargs = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
        if device.type == "cuda":
            dist.init_process_group("nccl", device_id=device, **kwargs)
        else:
            dist.init_process_group("gloo", **kwargs)
    return device


def check_device() -> torch.device | None:
    """On NCCL ranks: this rank's device (the current one) must be ``LOCAL_RANK``'s GPU when
    torchrun set it, and no two ranks of the default group may share one GPU (compared by
    UUID, so per-process ``CUDA_VISIBLE_DEVICES`` is fine). Collective: every rank gathers
    every rank's finding and all raise the same ``RuntimeError`` naming the ranks, so none
    waits on a rank that stopped. Returns the device (None on other backends)."""
    if dist.get_backend() != "nccl":
        return None
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device())
    local = os.environ.get("LOCAL_RANK")
    problem = None
    if local is not None and int(local) != device.index:
        problem = (f"rank {rank}: the current CUDA device is cuda:{device.index} but LOCAL_RANK "
                   f"is {local}: call torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) "
                   "before init_process_group (or use init_distributed_from_env)")
    gpu = (socket.gethostname(), str(torch.cuda.get_device_properties(device).uuid))
    seen: list = [None] * dist.get_world_size()
    dist.all_gather_object(seen, (gpu, device.index, problem))
    problems = [p for _, _, p in seen if p]
    if problems:
        raise RuntimeError("; ".join(problems))
    sharing = [r for r, (g, _, _) in enumerate(seen) if g == gpu]
    if len(sharing) > 1:
        raise RuntimeError(f"ranks {sharing} all use one GPU (cuda:{device.index} on "
                           f"{gpu[0]}): one GPU per rank, set each rank's device from LOCAL_RANK")
    return device


__all__ = ["check_device", "init_distributed_from_env"]
