"""diffusers' context-parallel sharding, set up for a SwiftFusion strategy.

diffusers' hooks (``hooks/context_parallel.py``) split every input its ``_cp_plan`` names into
``W`` equal chunks with ``tensor.chunk(W, dim)[rank in the flattened ("ring", "ulysses")
mesh]`` and all-gather the outputs in the same order. A mesh of shape ``(ring=1,
ulysses=W)`` over the default group flattens to ranks ``0..W-1``: rank i holds the i-th
contiguous chunk, which is the order ``SequenceParallelContext.attention`` expects. The
degrees in that config only choose diffusers' own templated attention, which the routed
backends bypass.
"""
from __future__ import annotations

import contextlib
import threading
from collections import Counter
from typing import Any, Iterator

import torch
import torch.distributed as dist

HOOK_NAME = "swiftfusion---uneven-sequence"

_meshes: dict[tuple[str, int], tuple[Any, Any]] = {}  # (device type, W) -> (group, mesh)
_mesh_lock = threading.Lock()


def cp_mesh(world: int):
    """The ``("ring", "ulysses")`` DeviceMesh of shape ``(1, world)`` over the default group,
    built once per process and default group (building one is collective)."""
    device_type = torch._C._get_accelerator().type
    key = (device_type, world)
    with _mesh_lock:
        group, mesh = _meshes.get(key, (None, None))
        if group is not dist.group.WORLD:
            from torch.distributed.device_mesh import init_device_mesh
            mesh = init_device_mesh(device_type, (1, world), mesh_dim_names=("ring", "ulysses"))
            _meshes[key] = (dist.group.WORLD, mesh)
        return mesh


@contextlib.contextmanager
def accelerator_count_at_least_one() -> Iterator[None]:
    """diffusers 0.42 places a context-parallel rank on device ``rank %
    torch.accelerator.device_count()``, which divides by zero on a host without accelerators;
    there the count reads 1 for the duration (the CPU device it then records is not used)."""
    if torch.accelerator.device_count() > 0:
        yield
        return
    real = torch.accelerator.device_count
    torch.accelerator.device_count = lambda *args, **kwargs: 1
    try:
        yield
    finally:
        torch.accelerator.device_count = real


def model_heads(model: torch.nn.Module) -> int:
    """``config.num_attention_heads``, else the most common ``heads`` of the model's attention
    modules."""
    heads = getattr(getattr(model, "config", None), "num_attention_heads", None)
    if heads:
        return int(heads)
    counts = Counter(int(m.heads) for m in model.modules()
                     if hasattr(m, "processor") and isinstance(getattr(m, "heads", None), int))
    if not counts:
        raise ValueError(f"cannot tell the attention head count of {type(model).__name__}; "
                         "pass num_heads=")
    return counts.most_common(1)[0][0]


def check_adoptable(model: torch.nn.Module, config: Any, world: int) -> None:
    """A model whose diffusers context parallelism is already on can be taken over only if it
    splits over the whole default group in equal chunks."""
    cp = getattr(config, "context_parallel_config", None)
    name = type(model).__name__
    if cp is None:
        raise ValueError(f"{name} already runs diffusers' tensor parallelism; SwiftFusion "
                         "strategies need context parallelism over every rank")
    if cp.ulysses_anything or cp.ring_anything:
        raise ValueError(f"{name} runs diffusers' context parallelism with ulysses_anything / "
                         "ring_anything (uneven chunks); SwiftFusion strategies need equal "
                         "chunks on every rank")
    size = cp._flattened_mesh.size()
    if size != world:
        raise ValueError(f"{name}'s context-parallel mesh has {size} ranks but the default process "
                         f"group has {world}; SwiftFusion strategies run over the whole group")


def processors_with_config(model: torch.nn.Module) -> Iterator[Any]:
    """Attention processors of ``model`` that take diffusers' ``_parallel_config``."""
    for module in model.modules():
        processor = getattr(module, "processor", None)
        if processor is not None and hasattr(processor, "_parallel_config"):
            yield processor


def remove_diffusers_cp(model: torch.nn.Module) -> None:
    """diffusers' context parallelism off (diffusers has no inverse of ``enable_parallelism``):
    its split/gather hooks leave every module, newest first, and neither the processors nor
    the model hold a parallel config. Works on a half-applied plan too."""
    from diffusers.hooks.context_parallel import (_CONTEXT_PARALLEL_INPUT_HOOK_TEMPLATE,
                                                  _CONTEXT_PARALLEL_OUTPUT_HOOK_TEMPLATE)
    prefixes = (_CONTEXT_PARALLEL_INPUT_HOOK_TEMPLATE.format(""),
                _CONTEXT_PARALLEL_OUTPUT_HOOK_TEMPLATE.format(""))
    for module in model.modules():
        registry = getattr(module, "_diffusers_hook", None)
        if registry is None:
            continue
        for name in reversed([n for n in registry._hook_order if n.startswith(prefixes)]):
            registry.remove_hook(name, recurse=False)
    for processor in processors_with_config(model):
        processor._parallel_config = None
    model._parallel_config = None


def split_inputs(plan: dict) -> list[str]:
    """``module: input`` for every tensor the plan splits (for error messages)."""
    from diffusers.models._modeling_parallel import ContextParallelInput
    out = []
    for module_id, entry in plan.items():
        if isinstance(entry, dict):
            for key, spec in entry.items():
                specs = spec if isinstance(spec, (list, tuple)) else [spec]
                if any(isinstance(s, ContextParallelInput) for s in specs):
                    out.append(f"{module_id or '<model>'}: {key}")
    return out


def add_uneven_error_hook(model: torch.nn.Module, world: int, plan: dict) -> None:
    """Turn the assertion of diffusers' equal split into a ``ValueError`` that says which
    inputs are split and what fixes it (outermost hook on the model)."""
    from diffusers.hooks.hooks import HookRegistry, ModelHook

    inputs = split_inputs(plan)
    name = type(model).__name__

    class UnevenSequenceHook(ModelHook):
        def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            try:
                return self.fn_ref.original_forward(*args, **kwargs)
            except AssertionError as exc:
                if "must be divisible by mesh size" not in str(exc):
                    raise
                raise ValueError(
                    f"{name}: context parallelism over {world} ranks splits these inputs into "
                    f"{world} equal chunks and one of them is not divisible by {world}: "
                    f"{', '.join(inputs)}. Choose a resolution, frame count or text length whose "
                    f"token counts are multiples of {world} (SwiftFusion strategies need the same "
                    "local length on every rank; diffusers' uneven ulysses_anything / "
                    "ring_anything modes are not supported)") from exc

    HookRegistry.check_if_exists_or_initialize(model).register_hook(UnevenSequenceHook(), HOOK_NAME)


def remove_uneven_error_hook(model: torch.nn.Module) -> None:
    registry = getattr(model, "_diffusers_hook", None)
    if registry is not None and registry.get_hook(HOOK_NAME) is not None:
        registry.remove_hook(HOOK_NAME, recurse=False)


__all__ = ["HOOK_NAME", "accelerator_count_at_least_one", "add_uneven_error_hook",
           "check_adoptable", "cp_mesh", "model_heads", "processors_with_config",
           "remove_diffusers_cp", "remove_uneven_error_hook", "split_inputs"]
