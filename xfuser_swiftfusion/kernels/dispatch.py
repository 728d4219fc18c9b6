"""Backend selection and the public ``attend`` entry point.

Backends:

* "triton": the fused multi-chunk kernel; CUDA sm_80+ with D in {32, 64, 128} and fp16/bf16
  (also runs on CPU tensors under ``TRITON_INTERPRET=1``, fp32 included, where the installed
  triton's interpreter works: ``interpret.interpreter_problem``);
* "flash": flash-attn, one call per Q chunk on the concatenated K/V + merge; CUDA sm_80+,
  fp16/bf16, D <= 256 and a multiple of 8;
* "cudnn": cuDNN's fused attention through torch (the FlashAttention-3-class kernel on
  Hopper) + merge; CUDA sm_80-sm_121, fp16/bf16, D <= 128 and a multiple of 8;
* "torch": torch's own CUDA attention ops that return an LSE + merge; any head dim, fp32 too;
* "cpu": torch's CPU flash attention + merge.

The choice is made per call from the device and the (head dim, dtype) of the inputs:
``set_backend(name)`` > env ``SWIFTFUSION_KERNEL`` > "auto", which takes the first backend
that is installed and supports the shape, in the order of the measured table for this GPU's
architecture and shape where one exists (``choice.py``), else of ``AUTO_ORDER`` (("triton",
"flash", "torch") on CUDA; ("cpu",) elsewhere). An explicit request that cannot run the shape
is an error naming the constraint. Choices are cached per (device, head dim, dtype) and logged
once.

Grouped-query attention: K/V chunks may have fewer heads H_kv (dividing the query heads H);
query head i uses K/V head i // (H / H_kv). triton and flash read the shared K/V heads in
place; cudnn, torch and cpu repeat them. Key masks (``key_masks``, one ``[B, Lk_j]`` bool per
K/V chunk, True = attend) run on the backends with a key mask and an LSE: "cpu" on CPU
tensors, "torch" (memory-efficient attention with an additive bias) on CUDA. A masked call
whose chosen backend is triton, flash or cudnn runs there instead (a per-call choice, logged
once).
"""
from __future__ import annotations

import functools
import importlib.util
import logging
import os
from collections.abc import Callable, Sequence

import torch

from .. import plan
from ..log import get_logger, log_once
from . import choice
from . import flash as flash_backend
from .interpret import interpreter_problem, interpreting
from .state import AttnState, finalize as finalize_state

logger = get_logger("xfuser_swiftfusion.kernels")

BACKENDS = ("triton", "flash", "cudnn", "torch", "cpu")
ENV_VAR = "SWIFTFUSION_KERNEL"
AUTO_ORDER = {"cuda": ("triton", "flash", "torch")}  # any other device type: ("cpu",)
TRITON_HEAD_DIMS = (32, 64, 128)  # triton_attend.SUPPORTED_HEAD_DIMS, without importing triton

_override: str | None = None
_chosen: dict[tuple, str] = {}  # (device type, index, head dim, dtype) -> backend name
_calls = 0  # attend calls with at least one Q chunk, in this process


def _installed(package: str) -> bool:
    """Whether ``package`` can be imported (found without importing it)."""
    return importlib.util.find_spec(package) is not None


def _missing(name: str, device: torch.device) -> str | None:
    """Why backend ``name`` cannot run on ``device`` at all (whatever the shape), or None."""
    if name == "cpu":
        return None if device.type == "cpu" else f"CPU tensors (got a {device.type} device)"
    if name in ("flash", "cudnn", "torch") and device.type != "cuda":
        return f"a CUDA device (got {device.type})"
    if name == "flash":
        if not _installed("flash_attn"):
            return "the flash_attn package (pip install flash-attn)"
        return None
    if name in ("cudnn", "torch"):
        return None
    if not _installed("triton"):
        return "the triton package"
    if device.type == "cuda":
        return None
    if not interpreting():
        return f"a CUDA device or TRITON_INTERPRET=1 (got {device.type})"
    problem = interpreter_problem()
    return None if problem is None else f"a working interpreter on {device.type}: {problem}"


def _unsupported(
    name: str, device: torch.device, head_dim: int, dtype: torch.dtype, capability: tuple[int, int] | None
) -> str | None:
    """Why backend ``name`` (available on ``device``) cannot run inputs of ``head_dim`` and
    ``dtype``, or None. ``capability``: the CUDA device's (major, minor); unused elsewhere."""
    cuda = device.type == "cuda"
    if cuda and capability is None:
        capability = torch.cuda.get_device_capability(device)
    if name == "triton":
        if head_dim not in TRITON_HEAD_DIMS:
            return f"head dim in {TRITON_HEAD_DIMS} (got {head_dim})"
        if dtype not in (torch.float16, torch.bfloat16) and (cuda or dtype != torch.float32):
            return f"fp16/bf16 inputs, fp32 only when interpreting (got {dtype})"
        if cuda and capability < (8, 0):
            return f"sm_80 or newer (got sm_{capability[0]}{capability[1]})"
        return None
    if name == "flash":
        return flash_backend.supports(head_dim, dtype, capability)
    if name == "cudnn":
        from .torch_cuda import cudnn_supports

        return cudnn_supports(head_dim, dtype, capability, torch.backends.cudnn.is_available())
    if name == "torch":
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return f"fp16/bf16/fp32 inputs (got {dtype})"
        if dtype == torch.bfloat16 and capability < (8, 0):
            return f"sm_80 or newer for bf16 (got sm_{capability[0]}{capability[1]})"
        return None
    return None


def _shape_text(head_dim: int, dtype: torch.dtype) -> str:
    return f"head dim {head_dim}, {str(dtype).removeprefix('torch.')}"


def _select(
    device: torch.device,
    name: str,
    head_dim: int | None,
    dtype: torch.dtype | None,
    capability: tuple[int, int] | None,
) -> tuple[str, dict[str, str]]:
    """(backend, {skipped backend: why}) for request ``name`` ("auto" or one of ``BACKENDS``)."""
    shaped = head_dim is not None and dtype is not None

    def why_not(n: str) -> str | None:
        missing = _missing(n, device)
        if missing is not None or not shaped:
            return missing
        return _unsupported(n, device, head_dim, dtype, capability)

    if name == "auto":
        order = auto_order(device, head_dim, dtype, capability)[0]
        reasons: dict[str, str] = {}
        for n in order:
            reason = why_not(n)
            if reason is None:
                if _missing(order[0], device) is not None:
                    log_once(logger, f"kernel-auto-{device.type}",
                             f"kernel auto: {order[0]} needs {_missing(order[0], device)}; using the next "
                             f"backend that can run each shape")  # fmt: skip
                return n, reasons
            reasons[n] = reason
        what = f"on {device.type}" + (f" for {_shape_text(head_dim, dtype)}" if shaped else "")
        raise RuntimeError(f"no attention kernel can run {what}: "
                           + "; ".join(f"{n} needs {r}" for n, r in reasons.items()))  # fmt: skip
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; choose one of ('auto', *{BACKENDS})")
    missing = _missing(name, device)
    if missing is not None:
        raise RuntimeError(f"kernel backend {name!r} needs {missing}")
    if shaped:
        reason = _unsupported(name, device, head_dim, dtype, capability)
        if reason is not None:
            raise RuntimeError(f"kernel backend {name!r} needs {reason}, for inputs of {_shape_text(head_dim, dtype)}")
    return name, {}


def auto_order(device: torch.device, head_dim: int | None, dtype: torch.dtype | None,
               capability: tuple[int, int] | None = None) -> tuple[tuple[str, ...], str]:
    """(backends in the order "auto" tries them, where that order comes from): on CUDA the
    measured table's entry for the GPU's architecture and the shape, followed by the rest of
    ``AUTO_ORDER``; without an entry (or a table), ``AUTO_ORDER``."""
    default = AUTO_ORDER.get(device.type, ("cpu",))
    if device.type != "cuda" or head_dim is None or dtype is None:
        return default, "default order"
    table = choice.load_table(BACKENDS)
    if table is None:
        return default, "default order"
    if capability is None:
        capability = torch.cuda.get_device_capability(device)
    measured = table.order(capability, head_dim, dtype)
    if measured is None:
        return default, "default order"
    rest = tuple(n for n in default if n not in measured)
    return (*measured, *rest), f"measured order for {choice.arch_key(capability)} ({table.path})"


def select_backend(
    device: torch.device,
    override: str | None = None,
    head_dim: int | None = None,
    dtype: torch.dtype | None = None,
    capability: tuple[int, int] | None = None,
) -> str:
    """Backend name for inputs on ``device``: ``override``, else env SWIFTFUSION_KERNEL, else
    "auto" (the first of ``AUTO_ORDER`` that can run). With ``head_dim`` and ``dtype`` the
    choice also honours what each backend supports for that shape (``capability``: the CUDA
    device's (major, minor), read from the device when None); without them only whether it
    can run on the device at all. Raises ValueError for an unknown name, RuntimeError for a
    request (or "auto") that cannot run here."""
    name = override or os.environ.get(ENV_VAR) or "auto"
    return _select(torch.device(device), name, head_dim, dtype, capability)[0]


def set_backend(name: str | None) -> None:
    """Force backend ``name`` for all later ``attend`` calls (None: back to automatic)."""
    global _override
    if name is not None and name not in (*BACKENDS, "auto"):
        raise ValueError(f"unknown kernel backend {name!r}; choose one of {BACKENDS}")
    _override = name
    _chosen.clear()


def current_backend(device: torch.device, head_dim: int | None = None, dtype: torch.dtype | None = None) -> str:
    """The backend ``attend`` uses for inputs of (``head_dim``, ``dtype``) on ``device``; the
    choice is cached and, the first time per shape, logged with the reasons any preferred
    backend was passed over. Without a shape: the backend for the device as a whole."""
    device = torch.device(device)
    key = (device.type, device.index, head_dim, dtype)
    name = _chosen.get(key)
    if name is None:
        requested = _override or os.environ.get(ENV_VAR) or "auto"
        name, skipped = _select(device, requested, head_dim, dtype, None)
        _chosen[key] = name
        if head_dim is not None:
            because = "".join(f"; {n} needs {why}" for n, why in skipped.items())
            if requested == "auto":
                because += f" ({auto_order(device, head_dim, dtype)[1]})"
            logger.info("swiftfusion attention kernel backend for %s, %s: %s%s",
                        device.type, _shape_text(head_dim, dtype), name, because)  # fmt: skip
    return name


def attend_calls() -> int:
    """Number of ``attend`` calls with at least one Q chunk made in this process."""
    return _calls


def add_attend_calls(n: int) -> None:
    """Count ``n`` calls that ran without Python (a CUDA graph's replay)."""
    global _calls
    _calls += n


MASK_BACKENDS = {"cuda": "torch"}  # device type -> backend of key-masked calls (else "cpu")


def masked_backend(device: torch.device, backend: str) -> str:
    """The backend a key-masked call runs on where ``backend`` was chosen for the shape:
    ``backend`` itself if it takes a key mask, else the device's mask backend (logged once)."""
    if backend in ("cpu", "torch"):
        return backend
    name = MASK_BACKENDS.get(device.type, "cpu")
    log_once(logger, f"kernel-mask-{device.type}-{backend}",
             f"kernel {backend} has no key mask: key-masked attention calls run on {name}",
             logging.INFO)
    return name


def _check_args(q_chunks, kv_chunks, states, out, key_masks=None) -> None:
    """Shapes, dtypes and devices; every backend relies on these."""
    if len(states) != len(q_chunks) or (out is not None and len(out) != len(q_chunks)):
        raise ValueError("need one state (and one output, if given) per Q chunk")
    B, H, _, D = q_chunks[0].shape
    device = q_chunks[0].device
    for i, (q, s) in enumerate(zip(q_chunks, states)):
        if q.dim() != 4 or (q.shape[0], q.shape[1], q.shape[3]) != (B, H, D):
            raise ValueError(f"Q chunk {tuple(q.shape)} does not match [B={B}, H={H}, L, D={D}]")
        if s.acc.shape != q.shape or s.m.shape != q.shape[:3] or s.l.shape != q.shape[:3]:
            raise ValueError("AttnState shapes do not match their Q chunk")
        if any(t.dtype != torch.float32 or t.device != device for t in (s.acc, s.m, s.l)):
            raise TypeError("AttnState tensors must be fp32 on the device of the queries")
        if out is not None and out[i].shape != q.shape:
            raise ValueError(f"output {tuple(out[i].shape)} does not match its Q chunk {tuple(q.shape)}")
    heads_kv = {k.shape[1] for k, _ in kv_chunks if k.dim() == 4}
    for k, v in kv_chunks:
        if (k.shape != v.shape or k.dim() != 4 or (k.shape[0], k.shape[3]) != (B, D)
                or len(heads_kv) > 1 or k.shape[1] == 0 or H % k.shape[1]):
            raise ValueError(f"K {tuple(k.shape)} / V {tuple(v.shape)} do not match [B={B}, H_kv, L, D={D}] "
                             f"with one H_kv dividing H={H} for all chunks (got H_kv {sorted(heads_kv)})")
    if key_masks is not None:
        if len(key_masks) != len(kv_chunks):
            raise ValueError(f"need one key mask (or None) per K/V chunk: {len(key_masks)} for {len(kv_chunks)}")
        for m, (k, _) in zip(key_masks, kv_chunks):
            if m is not None and (m.dtype != torch.bool or tuple(m.shape) != (B, k.shape[2]) or m.device != device):
                raise ValueError(f"a key mask must be bool [B={B}, Lk={k.shape[2]}] on {device}, got "
                                 f"{m.dtype} {tuple(m.shape)} on {m.device}")
    inputs = [*q_chunks, *(t for kv in kv_chunks for t in kv)]
    if len({t.dtype for t in inputs}) > 1:
        raise TypeError(f"Q, K and V chunks must share one dtype, got {sorted({str(t.dtype) for t in inputs})}")
    if any(t.device != device for t in inputs):
        raise ValueError("all Q, K and V chunks must be on one device")


def new_states(q_chunks: Sequence[torch.Tensor]) -> list[AttnState]:
    """Empty running states (acc 0, m -inf, l 0) for query chunks ``[B, H, L_i, D]``: views of
    three fp32 buffers (acc, m, l), reset by three fills (a plan's step: ``plan.call``). Chunks
    must share B, H, D and the device."""
    if not q_chunks:
        return []
    B, H, _, D = q_chunks[0].shape
    device = q_chunks[0].device
    rows = [B * H * q.shape[2] for q in q_chunks]
    acc = torch.empty(sum(rows) * D, dtype=torch.float32, device=device)
    m = torch.empty(sum(rows), dtype=torch.float32, device=device)
    l = torch.empty(sum(rows), dtype=torch.float32, device=device)
    states, at = [], 0
    for q, n in zip(q_chunks, rows):
        L = q.shape[2]
        # flat [n * D] / [n] slices -> [B, H, L, D] / [B, H, L]
        states.append(AttnState(acc[at * D:(at + n) * D].view(B, H, L, D),
                                m[at:at + n].view(B, H, L), l[at:at + n].view(B, H, L)))
        at += n

    def reset() -> None:
        acc.zero_()
        l.zero_()
        m.fill_(float("-inf"))

    plan.call(reset)
    return states


def attend(
    q_chunks: Sequence[torch.Tensor],
    kv_chunks: Sequence[tuple[torch.Tensor, torch.Tensor]],
    states: Sequence[AttnState],
    *,
    scale: float,
    finalize: bool = False,
    out: Sequence[torch.Tensor] | None = None,
    key_masks: Sequence[torch.Tensor | None] | None = None,
) -> list[torch.Tensor] | None:
    """Full (non-causal) attention of every Q chunk [B, H, Lq_i, D] against every KV chunk
    (K_j, V_j) [B, H_kv, Lk_j, D] (H_kv dividing H: query head i uses K/V head
    i // (H / H_kv)), merged into ``states[i]`` in place.

    ``key_masks``: None, or per KV chunk a bool ``[B, Lk_j]`` (True = attend) or None (every
    key); masked keys are excluded, and a row whose keys in this call are all masked gains
    nothing (its partial LSE is -inf). Lengths may be anything, including 0; ``kv_chunks``
    may be empty. With ``finalize``, also returns the outputs acc / l [B, H, Lq_i, D] in the
    query dtype (written into ``out[i]`` if given); rows that saw no (unmasked) keys at all
    output 0. Without ``finalize`` returns None.

    A plan's step (``plan.call``): the inputs are checked, the backend chosen and its launch
    prepared here (the triton kernel's chunk table built and uploaded once); the step launches.
    """
    q_chunks, kv_chunks = list(q_chunks), list(kv_chunks)
    if not q_chunks:
        return [] if finalize else None
    key_masks = None if key_masks is None or all(m is None for m in key_masks) else list(key_masks)
    _check_args(q_chunks, kv_chunks, states, out, key_masks)
    q0 = q_chunks[0]
    backend = current_backend(q0.device, q0.shape[-1], q0.dtype)
    if key_masks is not None:
        backend = masked_backend(q0.device, backend)
    if finalize and out is None:
        out = [torch.empty(q.shape, dtype=q.dtype, device=q.device) for q in q_chunks]
    with plan.preparing():
        launch = _prepare(backend, q_chunks, kv_chunks, list(states), scale,
                          list(out) if finalize else None, key_masks)
    plan.call(launch)
    return list(out) if finalize else None


def _counted(fn: Callable[[], None]) -> Callable[[], None]:
    def launch() -> None:
        global _calls
        _calls += 1
        fn()
    return launch


def _prepare(backend: str, q_chunks: list[torch.Tensor], kv_chunks: list[tuple[torch.Tensor, torch.Tensor]],
             states: list[AttnState], scale: float, out: list[torch.Tensor] | None,
             key_masks: list[torch.Tensor | None] | None) -> Callable[[], None]:
    """The work of one ``attend`` call on ``backend``, ready to run (counted by ``attend_calls``):
    triton's launch prepared (``prepare_triton``); cudnn's and torch's op call and fused
    combine prepared on CUDA tensors without key masks (``prepare_torch``); flash-attn's and
    key-masked calls as one op call and one combine per run; the CPU op with torch's merges."""
    if backend == "triton":
        return _counted(_prepare_triton(q_chunks, kv_chunks, states, scale, out))
    masked = {} if key_masks is None else {"key_masks": key_masks}
    if backend in ("cudnn", "torch") and key_masks is None and q_chunks[0].is_cuda:
        return _counted(_prepare_sdpa(backend, q_chunks, kv_chunks, states, scale, out))
    if backend == "flash":
        return _counted(functools.partial(flash_backend.attend_flash, q_chunks, kv_chunks, states,
                                          scale, out=out))
    if backend in ("cudnn", "torch"):
        from .torch_cuda import attend_torch, cudnn_op

        op = {"op": cudnn_op} if backend == "cudnn" else {}
        return _counted(functools.partial(attend_torch, q_chunks, kv_chunks, states, scale, out=out,
                                          **op, **masked))
    from .cpu import attend_cpu

    run = functools.partial(attend_cpu, q_chunks, kv_chunks, states, scale, **masked)
    return _counted(run if out is None else _then_finalize(run, q_chunks, states, out))


def _then_finalize(run: Callable[[], None], q_chunks: list[torch.Tensor], states: list[AttnState],
                   out: list[torch.Tensor]) -> Callable[[], None]:
    """``run``, then each state's output acc / l into ``out`` (torch ops)."""
    pairs = [(s, q.dtype, o) for q, s, o in zip(q_chunks, states, out)]

    def run_and_finalize() -> None:
        run()
        for s, dtype, o in pairs:
            finalize_state(s, dtype, o)

    return run_and_finalize


def _prepare_sdpa(backend: str, q_chunks: list[torch.Tensor],
                  kv_chunks: list[tuple[torch.Tensor, torch.Tensor]], states: list[AttnState],
                  scale: float, out: list[torch.Tensor] | None) -> Callable[[], None]:
    """``torch_cuda.prepare_torch`` on the chunks with rows (cudnn: cuDNN's op; torch: the op
    ``cuda_op`` picks); without keys, the finalization alone (one combine launch)."""
    from .combine import prepare_combine
    from .torch_cuda import cudnn_op, prepare_torch

    rows = [i for i, q in enumerate(q_chunks) if q.shape[2] > 0]
    kvs = [(k, v) for k, v in kv_chunks if k.shape[2] > 0]
    outs = None if out is None else [out[i] for i in rows]
    if not rows:
        return _no_op
    if not kvs:
        return _no_op if out is None else prepare_combine([states[i] for i in rows], None, None, outs)
    return prepare_torch([q_chunks[i] for i in rows], kvs, [states[i] for i in rows], scale,
                         op=cudnn_op if backend == "cudnn" else None, out=outs)


def _prepare_triton(q_chunks: list[torch.Tensor], kv_chunks: list[tuple[torch.Tensor, torch.Tensor]],
                    states: list[AttnState], scale: float,
                    out: list[torch.Tensor] | None) -> Callable[[], None]:
    """``triton_attend.prepare_triton``'s launch (split along K/V and merged by the combine
    where the launch alone would leave SMs idle; a configuration the GPU refuses replaced by
    the safe one); where there is nothing to launch (no query rows, or no keys) the
    finalization from the states alone."""
    from . import triton_attend as ta

    if not any(q.shape[2] for q in q_chunks):
        return _no_op
    if not any(k.shape[2] for k, _ in kv_chunks):
        return _no_op if out is None else _then_finalize(_no_op, q_chunks, states, out)
    return ta.prepare_triton(q_chunks, kv_chunks, states, scale, out)


def _no_op() -> None:
    pass
