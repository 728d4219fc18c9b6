"""Run-time CPU compatibility for xfuser 0.7.0 (and yunchang 0.6.4).

``apply()`` makes ``import xfuser`` and xFuser's own ``USP()`` work on a machine without CUDA
(gloo process groups, CPU tensors). Nothing in site-packages is edited: every change is a small
named patch applied to a module object right after that module has been executed, through a
post-import hook (``hooks.on_import``, wrapt's). Modules already imported when ``apply()`` runs are patched
at once; modules imported later (xFuser loads model code lazily) are patched as they load.

Why a post-import hook: ``xfuser.envs`` must be patched before the rest of xFuser reads it
(``xfuser/config/config.py`` evaluates ``envs.CUDA_VERSION`` at import, which raises "No
Accelerators" on CPU), but ``import xfuser.envs`` first executes ``xfuser/__init__.py``, which
imports all of xFuser, so envs cannot be imported and patched "first". Patching ``xfuser.envs``
the moment it finishes executing is the narrowest seam that needs no fake CUDA.

``apply()`` is a no-op when ``torch.cuda.is_available()``, and idempotent. It also lets xFuser's
runner (``xdit`` / ``python -m xfuser.runner``) run on CPU: timing with ``time.perf_counter``
instead of CUDA events, no CUDA sync, the pipeline left on CPU. The same changes as source diffs
against pristine xfuser 0.7.0 live in ``patches/xfuser-0.7.0-cpu.patch`` and (runner)
``patches/xfuser-0.7.0-plugin.patch``.
"""
from __future__ import annotations

import sys
import threading
import time
from types import ModuleType
from typing import Callable

import torch

from .hooks import on_import

_PATCHED_ATTR = "__swiftfusion_cpu_patch__"
_lock = threading.RLock()
_applied = False


# --------------------------------------------------------------------------------------------
# Individual patches. Each takes the freshly executed module and changes one thing.
# --------------------------------------------------------------------------------------------

def _mark(fn: Callable, original: Callable) -> Callable:
    setattr(fn, _PATCHED_ATTR, True)
    fn.__wrapped__ = original  # type: ignore[attr-defined]
    fn.__name__ = getattr(original, "__name__", fn.__name__)
    fn.__qualname__ = getattr(original, "__qualname__", fn.__qualname__)
    return fn


def _is_patched(fn: object) -> bool:
    return bool(getattr(fn, _PATCHED_ATTR, False))


def patch_envs_cuda_build_without_gpu(envs: ModuleType) -> None:
    """A CUDA build of torch on a machine without a GPU (``torch.version.cuda`` set, no driver):
    xfuser.envs._is_cuda() says True, so xFuser calls torch.cuda.set_device and picks NCCL;
    report False, as a CPU build of torch does (``apply`` runs only without CUDA)."""
    original = envs._is_cuda
    if _is_patched(original):
        return

    def _is_cuda() -> bool:
        return original() and torch.cuda.is_available()

    envs._is_cuda = _mark(_is_cuda, original)


def patch_envs_device_version(envs: ModuleType) -> None:
    """xfuser.envs.get_device_version() raises "No Accelerators" on CPU (breaking `import xfuser`
    via envs.CUDA_VERSION); return None there, as it already does for MPS/NPU."""
    original = envs.get_device_version
    if _is_patched(original):
        return

    def get_device_version():
        try:
            return original()
        except NotImplementedError:
            return None

    envs.get_device_version = _mark(get_device_version, original)


def patch_envs_distributed_backend(envs: ModuleType) -> None:
    """xfuser.envs.get_torch_distributed_backend() raises on CPU; return "gloo" there."""
    original = envs.get_torch_distributed_backend
    if _is_patched(original):
        return

    def get_torch_distributed_backend() -> str:
        try:
            return original()
        except NotImplementedError:
            return "gloo"

    envs.get_torch_distributed_backend = _mark(get_torch_distributed_backend, original)


def patch_envs_long_ctx_check(envs: ModuleType) -> None:
    """PackagesEnvChecker.check_long_ctx_attn() is False without CUDA, which disables USP and
    yunchang's process groups; report yunchang's real availability on CPU too."""
    checker_cls = envs.PackagesEnvChecker
    original = checker_cls.check_long_ctx_attn
    if not _is_patched(original):
        def check_long_ctx_attn(self):
            if original(self):
                return True
            try:
                from yunchang import (  # noqa: F401  (same probe as xFuser's)
                    LongContextAttention,
                    set_seq_parallel_pg,
                )
            except ImportError:
                return False
            return True

        checker_cls.check_long_ctx_attn = _mark(check_long_ctx_attn, original)
    # The singleton ran its probe while envs executed; every xFuser module copies the flag
    # (HAS_LONG_CTX_ATTN = env_info["has_long_ctx_attn"]) when it is imported, so the shared
    # dict must hold the corrected value before any of them loads.
    info = envs.PACKAGES_CHECKER.packages_info
    if not info.get("has_long_ctx_attn"):
        info["has_long_ctx_attn"] = envs.PACKAGES_CHECKER.check_long_ctx_attn()
    if info["has_long_ctx_attn"]:
        # Modules that were imported before apply() ran hold a stale copy of the flag.
        for name, mod in list(sys.modules.items()):
            if (name.startswith("xfuser.") and mod is not None
                    and getattr(mod, "HAS_LONG_CTX_ATTN", None) is False):
                mod.HAS_LONG_CTX_ATTN = True


def patch_envs_gpu_arch(envs: ModuleType) -> None:
    """PackagesEnvChecker._on_rdna4() / _on_mi3xx() call torch.cuda.current_device(), which
    raises without CUDA (the runner's ``--use_torch_compile`` asks ``_on_rdna4()`` for the
    compile mode); no CUDA device is no AMD GPU: False."""
    checker_cls = envs.PackagesEnvChecker
    for name in ("_on_rdna4", "_on_mi3xx"):
        original = getattr(checker_cls, name)
        if _is_patched(original):
            continue

        def on_gpu_arch(self, _original=original):
            return torch.cuda.is_available() and _original(self)

        setattr(checker_cls, name, _mark(on_gpu_arch, original))


def _cpu_flash_attn_call(query, key, value, dropout_p, is_causal, attention_kwargs=None):
    """Attention with log-sum-exp on CPU: torch's CPU flash kernel, layout [B, H, L, D].

    Returns ``(out [B, H, Lq, D] in the input dtype, lse [B, H, Lq] fp32, natural log)``, which
    is what torch's ``_templated_ring_attention`` (USP's ring) merges with.
    """
    attn_mask = attention_kwargs.get("attn_mask") if attention_kwargs else None
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # the op takes additive masks
        attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype).masked_fill(
            ~attn_mask, float("-inf"))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p=dropout_p, is_causal=is_causal, attn_mask=attn_mask)
    return out, lse


def patch_sdpa_flash_backend_cpu(attention_backend: ModuleType) -> None:
    """The SDPA_FLASH backend calls aten._scaled_dot_product_flash_attention, which has no CPU
    kernel, and no other backend returns an LSE on CPU; route CPU tensors to torch's CPU flash op."""
    registry = attention_backend.ATTENTION_FUNCTION_REGISTRY
    key = attention_backend.AttentionBackendType.SDPA_FLASH
    original = registry[key]
    if _is_patched(original):
        return

    def _sdpa_flash_attn_call(query, key, value, dropout_p, is_causal, attention_kwargs=None):
        if query.device.type == "cpu":
            return _cpu_flash_attn_call(query, key, value, dropout_p, is_causal, attention_kwargs)
        return original(query, key, value, dropout_p, is_causal, attention_kwargs=attention_kwargs)

    registry[key] = _mark(_sdpa_flash_attn_call, original)


def patch_runtime_state_backend_selection(runtime_state: ModuleType) -> None:
    """RuntimeState picks SDPA on CPU, which returns no LSE (USP's ring then fails), or CUDNN
    with a CUDA build of torch on a machine without a GPU (cuDNN is "available" there); pick
    SDPA_FLASH (torch's CPU flash kernel, with LSE) when no backend was requested and there is
    no CUDA."""
    cls = runtime_state.RuntimeState
    original = cls._select_attention_backend
    if _is_patched(original):
        return
    backend_type = runtime_state.AttentionBackendType

    def _select_attention_backend(self, engine_config=None):
        backend = original(self, engine_config)
        explicit = bool(engine_config and engine_config.runtime_config.attention_backend)
        if (not explicit and backend in (backend_type.SDPA, backend_type.CUDNN)
                and not torch.cuda.is_available()):
            return backend_type.SDPA_FLASH
        return backend

    cls._select_attention_backend = _mark(_select_attention_backend, original)


def patch_process_group_global(module: ModuleType) -> None:
    """usp.py / head_balance.py / fp8_comms.py import yunchang's PROCESS_GROUP only when CUDA is
    available and leave None otherwise; bind the (singleton) yunchang object on CPU too."""
    if getattr(module, "PROCESS_GROUP", None) is None:
        from yunchang.globals import PROCESS_GROUP
        module.PROCESS_GROUP = PROCESS_GROUP


def _update_npu_out(out, softmax_max, softmax_sum, block_out, block_max, block_sum):
    """Merge one block into running (out, max, sum) softmax statistics (NPU ring layout)."""
    raise NotImplementedError("update_npu_out is an NPU-only helper (missing in yunchang 0.6.4)")


def patch_yunchang_update_npu_out(ring_utils: ModuleType) -> None:
    """xfuser's ring_npu_flash_attn.py imports update_npu_out from yunchang.ring.utils, which
    yunchang 0.6.4 lacks (ImportError breaks xFuserLongContextAttention); inject a stub that
    raises if an NPU code path ever calls it."""
    if not hasattr(ring_utils, "update_npu_out"):
        ring_utils.update_npu_out = _update_npu_out


class _PerfCounterEvent:
    """CPU stand-in for ``torch.cuda.Event(enable_timing=True)``: wall time by perf_counter."""

    def __init__(self, enable_timing: bool = False, **_: object) -> None:
        self._t: float | None = None

    def record(self, stream: object = None) -> None:
        self._t = time.perf_counter()

    def synchronize(self) -> None:
        """CPU work is synchronous: nothing to wait for."""

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: "_PerfCounterEvent") -> float:
        """Milliseconds from this event to ``end`` (CUDA's unit)."""
        if self._t is None or end._t is None:
            raise RuntimeError("elapsed_time needs both events recorded")
        return (end._t - self._t) * 1000.0


class _HostCuda:
    """The ``torch.cuda`` calls xFuser's runner makes for timing, syncing and memory logs,
    answered for a machine without CUDA (no device memory: 0 bytes). Anything else is torch's."""

    Event = _PerfCounterEvent

    @staticmethod
    def synchronize(device: object = None) -> None:
        """Nothing to wait for on CPU."""

    @staticmethod
    def empty_cache() -> None:
        """No device allocator on CPU."""

    @staticmethod
    def memory_allocated(device: object = None) -> int:
        return 0

    @staticmethod
    def max_memory_allocated(device: object = None) -> int:
        return 0

    @staticmethod
    def reset_peak_memory_stats(device: object = None) -> None:
        """No device allocator on CPU."""

    def __getattr__(self, name: str):
        return getattr(torch.cuda, name)


class _HostTorch(ModuleType):
    """``torch`` as seen by one xFuser module on CPU: ``torch.cuda`` is ``_HostCuda``."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _HostCuda()

    def __getattr__(self, name: str):
        return getattr(torch, name)


_HOST_TORCH = _HostTorch()


def patch_host_torch(module: ModuleType) -> None:
    """The runner (``xfuser/runner.py`` cleanup) and ``base_model.py`` (``run`` /
    ``_run_timed_pipe`` timing) call ``torch.cuda.Event/synchronize`` unconditionally; give
    these modules a ``torch`` whose ``cuda`` times with ``time.perf_counter`` on CPU."""
    if getattr(module, "torch", None) is torch:
        module.torch = _HOST_TORCH


class _HostPipe:
    """A pipeline whose ``.to("cuda:N")`` is a no-op on CPU (it already lives there)."""

    def __init__(self, pipe) -> None:
        self._pipe = pipe

    def to(self, *args, **kwargs):
        devices = [a for a in args if isinstance(a, (str, torch.device))]
        devices += [kwargs[k] for k in ("device",) if k in kwargs]
        if any(torch.device(d).type == "cuda" for d in devices):
            return self._pipe
        return self._pipe.to(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._pipe, name)


def patch_placement_host_device(placement: ModuleType) -> None:
    """``place_pipeline_components`` moves the pipeline to ``f"cuda:{local_rank}"``; on CPU
    the pipeline stays where ``from_pretrained`` put it."""
    original = placement.place_pipeline_components
    if _is_patched(original):
        return

    def place_pipeline_components(loader) -> None:
        model = loader.model
        model.pipe = _HostPipe(model.pipe)
        try:
            original(loader)
        finally:
            if isinstance(model.pipe, _HostPipe):
                model.pipe = model.pipe._pipe

    placement.place_pipeline_components = _mark(place_pipeline_components, original)


def patch_runner_main(base_model: ModuleType) -> None:
    """``python -m xfuser.runner`` runs the runner as ``__main__`` (runpy executes its code
    object directly, so no import hook sees it); it imports ``base_model`` right after
    ``import torch``, so give the ``__main__`` namespace the CPU ``torch`` here."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if main is not None and getattr(spec, "name", None) == "xfuser.runner":
        patch_host_torch(main)


# module name -> patches to run right after the module body has executed (CPU only)
_HOOKS: dict[str, tuple[Callable[[ModuleType], None], ...]] = {
    "xfuser.envs": (patch_envs_cuda_build_without_gpu, patch_envs_device_version,
                    patch_envs_distributed_backend,
                    patch_envs_long_ctx_check, patch_envs_gpu_arch),
    "xfuser.core.distributed.attention_backend": (patch_sdpa_flash_backend_cpu,),
    "xfuser.core.distributed.runtime_state": (patch_runtime_state_backend_selection,),
    "xfuser.model_executor.layers.usp": (patch_process_group_global,),
    "xfuser.core.sparge_attention.head_balance": (patch_process_group_global,),
    "xfuser.core.distributed.fp8_comms": (patch_process_group_global,),
    "yunchang.ring.utils": (patch_yunchang_update_npu_out,),
    "xfuser.model_executor.models.runner_models.base_model": (patch_host_torch,
                                                              patch_runner_main),
    "xfuser.model_executor.models.runner_models.loading.placement": (
        patch_placement_host_device,),
}


def _forget_failed_xfuser_import() -> None:
    """Drop submodules left behind by a failed `import xfuser` (xfuser itself is absent).

    Retrying the import with them present runs xFuser's circular imports in a different order
    (xfuser.config.args <-> xfuser.core.distributed.runtime_state) and fails; a clean retry
    follows xFuser's normal order and passes through the hook.
    """
    if "xfuser" in sys.modules:
        return
    for name in [n for n in sys.modules if n.startswith("xfuser.")]:
        del sys.modules[name]


def apply() -> None:
    """Make xfuser 0.7.0 importable and its USP runnable on CPU; no-op with CUDA; idempotent.
    Modules imported already (or left behind by a failed ``import xfuser``) are patched at
    once, envs first (the long-context flag fix-up scans the others); the rest as they load."""
    global _applied
    if torch.cuda.is_available():
        return
    with _lock:
        _forget_failed_xfuser_import()
        _applied = True
        for name, patches in _HOOKS.items():
            for patch in patches:
                on_import(name, patch)


def is_applied() -> bool:
    """True once apply() has run on a machine without CUDA."""
    return _applied


__all__ = ["apply", "is_applied"]
