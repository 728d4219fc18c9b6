"""Whether Triton runs its CPU interpreter, and whether that interpreter works here; read
without importing triton."""
from __future__ import annotations

import functools
import importlib.metadata
import os


def interpreting() -> bool:
    """True when Triton runs its CPU interpreter (``TRITON_INTERPRET=1``). Read without
    importing triton: triton.jit decides at decoration time whether to interpret."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _release(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as ``3.6.0`` or ``2.4.0rc1``."""
    major, minor = (version.split(".") + ["0"])[:2]
    digits = "".join(c for c in minor if c.isdigit()) or "0"
    return int(major), int(digits)


def interpreter_problem_for(triton: str, numpy: str) -> str | None:
    """Why Triton ``triton``'s interpreter cannot run with numpy ``numpy``, or None: Triton
    before 3.7 fails on numpy 2.4 and later (``TypeError: only 0-dimensional arrays can be
    converted to Python scalars`` inside the interpreter; fixed in 3.7)."""
    if _release(triton) < (3, 7) and _release(numpy) >= (2, 4):
        return (f"the triton {triton} interpreter fails with numpy {numpy} (numpy >= 2.4 needs "
                "triton >= 3.7)")
    return None


@functools.lru_cache(maxsize=None)
def interpreter_problem() -> str | None:
    """``interpreter_problem_for`` the installed triton and numpy (None if either is absent)."""
    try:
        triton, numpy = (importlib.metadata.version(p) for p in ("triton", "numpy"))
    except importlib.metadata.PackageNotFoundError:
        return None
    return interpreter_problem_for(triton, numpy)
