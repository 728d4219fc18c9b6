"""Whether Triton runs its CPU interpreter, read without importing triton."""
from __future__ import annotations

import os


def interpreting() -> bool:
    """True when Triton runs its CPU interpreter (``TRITON_INTERPRET=1``). Read without
    importing triton: triton.jit decides at decoration time whether to interpret."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
