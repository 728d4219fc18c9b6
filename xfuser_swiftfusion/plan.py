"""Execution plans: a layer compiled once per input signature, then run without per-chunk Python.

For one input signature (shapes, dtypes, text tokens, scale, kind of key mask, device) a
strategy's layer makes the same calls every time: kernel launches, transfers and their waits,
barriers, copies. ``compile(layer)`` runs the layer's Python once with each such call
*recorded* instead of executed, as a prepared *step*: the call's arguments (a launch's chunk
table, a transfer's byte runs, peers, streams, buffers) are checked and resolved at compile
time, and the step only issues the work. ``Plan.run`` executes the steps in order; the schedule
walk, the per-chunk checks and the buffer allocations happened once, at compile time.

The calls a layer records through:

- ``call(fn)``: a step that runs ``fn()`` (a launch, a copy, a barrier);
- ``issue(fn)``: a step that runs ``fn()`` and keeps the ``Handle`` it returns in a slot of
  the run; the stand-in handle returned at compile time records its ``wait()`` as a step;
- ``output(fn)``: the run's result, ``fn()``, evaluated after the steps (a new tensor per run);
  ``then(result, fn)`` post-processes it;
- ``preparing()``: a block of one-time work done at compile time (chunk tables uploaded,
  symmetric buffers allocated, indices built).

Outside ``compile`` the same functions act at once (``call(fn)`` is ``fn()``), so code written
against them also runs directly.

A plan holds tensors allocated at compile time (``torch.empty`` and its relatives: the plan's
buffers, reused by every run) and views of them. Work on data happens only inside steps:
during compile a guard (a ``TorchDispatchMode``) raises ``UnrecordedOp`` for any torch
operation outside a step and outside ``preparing()`` that is neither a view nor an
uninitialised allocation, so a plan cannot skip work its layer would have done.

Invariants of a layer that is compiled: its calls depend on the input signature only (never
on data: no ``.item()``, no data-dependent shapes), and every tensor a step touches outlives
the plan's runs (allocated at compile time, or a persistent buffer such as a symmetric one).
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

Step = Callable[[list], None]
"""One step of a run: called with the run's slots (the handles of ``issue`` steps)."""


class UnrecordedOp(RuntimeError):
    """A torch operation ran on data while a layer was being compiled, outside a step."""


_ALLOCATIONS = {
    torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
    torch.ops.aten.empty_like.default, torch.ops.aten.new_empty.default,
    torch.ops.aten.new_empty_strided.default,
}


def _is_view(func: Any) -> bool:
    """Whether an aten op only aliases its inputs (its results alias an input, it writes none)."""
    schema = func._schema
    if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        return False
    return bool(schema.returns) and all(r.alias_info is not None for r in schema.returns)


class _Guard(TorchDispatchMode):
    """During compile: views and uninitialised allocations pass; other ops only inside
    ``preparing()`` (``UnrecordedOp`` otherwise)."""

    def __init__(self, compiler: "_Compiler") -> None:
        super().__init__()
        self.compiler = compiler

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.compiler.preparing or func in _ALLOCATIONS or _is_view(func):
            return func(*args, **(kwargs or {}))
        raise UnrecordedOp(
            f"{func} ran on data while a layer was being compiled, outside a recorded step "
            "(plan.call/issue/output) and outside plan.preparing(): a run of the plan would skip it")


class _PlannedHandle:
    """Compile-time stand-in for the handle a step will keep in ``slot``; ``wait()`` records
    the wait."""

    __slots__ = ("_compiler", "_slot")

    def __init__(self, compiler: "_Compiler", slot: int) -> None:
        self._compiler, self._slot = compiler, slot

    def wait(self) -> None:
        self._compiler.steps.append(_wait_step(self._slot))


def _wait_step(slot: int) -> Step:
    def step(env: list) -> None:
        env[slot].wait()
    return step


def _issue_step(fn: Callable[[], Any], slot: int) -> Step:
    def step(env: list) -> None:
        env[slot] = fn()
    return step


def _call_step(fn: Callable[[], Any]) -> Step:
    def step(env: list) -> None:
        fn()
    return step


class _Compiler:
    def __init__(self) -> None:
        self.steps: list[Step] = []
        self.slots = 0
        self.output: Callable[[], Any] | None = None
        self.preparing = 0


_local = threading.local()


def _current() -> _Compiler | None:
    return getattr(_local, "compiler", None)


def compiling() -> bool:
    """Whether a layer is being compiled in this thread."""
    return _current() is not None


def call(fn: Callable[[], Any]) -> Any:
    """Record a step running ``fn()`` (returns None), or, outside compile, return ``fn()``."""
    c = _current()
    if c is None:
        return fn()
    c.steps.append(_call_step(fn))
    return None


def issue(fn: Callable[[], Any]) -> Any:
    """Record a step keeping ``fn()``'s handle and return a stand-in whose ``wait()`` is recorded;
    outside compile, return ``fn()``."""
    c = _current()
    if c is None:
        return fn()
    slot, c.slots = c.slots, c.slots + 1
    c.steps.append(_issue_step(fn, slot))
    return _PlannedHandle(c, slot)


def output(fn: Callable[[], Any]) -> Any:
    """The result of each run, ``fn()`` after the steps (returns None at compile time); outside
    compile, ``fn()``."""
    c = _current()
    if c is None:
        return fn()
    if c.output is not None:
        raise RuntimeError("a compiled layer has one output")
    c.output = fn
    return None


def then(result: Any, fn: Callable[[Any], Any]) -> Any:
    """``fn(result)``; at compile time the plan's output becomes ``fn`` of the output recorded
    so far (a layer that post-processes an inlined layer's result)."""
    c = _current()
    if c is None:
        return fn(result)
    if c.output is None:
        raise RuntimeError("plan.then before the layer's output was recorded")
    inner = c.output
    c.output = lambda: fn(inner())
    return None


@contextlib.contextmanager
def preparing() -> Iterator[None]:
    """One-time work of compiling (runs now; any torch operation allowed)."""
    c = _current()
    if c is None:
        yield
        return
    c.preparing += 1
    try:
        yield
    finally:
        c.preparing -= 1


class Plan:
    """A compiled layer: ``steps`` in order, ``slots`` handle slots, ``output`` the result."""

    __slots__ = ("steps", "slots", "output")

    def __init__(self, steps: list[Step], slots: int, output: Callable[[], Any] | None) -> None:
        self.steps, self.slots, self.output = steps, slots, output

    def run_steps(self) -> None:
        """The steps alone (what a CUDA graph captures)."""
        env: list = [None] * self.slots
        for step in self.steps:
            step(env)

    def run(self) -> Any:
        """The steps, then the output."""
        self.run_steps()
        return None if self.output is None else self.output()

    def __len__(self) -> int:
        return len(self.steps)


def compile(layer: Callable[..., Any], *args: Any, **kwargs: Any) -> Plan:  # noqa: A001
    """Run ``layer(*args, **kwargs)`` recording its calls (module docstring) into a ``Plan``;
    nothing of the layer runs. Not reentrant: a layer that calls another compiled layer inlines
    its calls."""
    if compiling():
        raise RuntimeError("plan.compile inside a compile: inline the inner layer's calls")
    c = _local.compiler = _Compiler()
    try:
        with _Guard(c):
            layer(*args, **kwargs)
    finally:
        _local.compiler = None
    return Plan(c.steps, c.slots, c.output)


__all__ = ["Plan", "Step", "UnrecordedOp", "call", "compile", "compiling", "issue", "output",
           "preparing", "then"]
