"""Puts tests/ first on ``sys.path`` so that test modules import ``support`` (tests/support)
under any pytest import mode; scripts/fuzz.py and scripts/soak.py import it the same way."""
from __future__ import annotations

import sys
from pathlib import Path

_TESTS = str(Path(__file__).resolve().parent)
if sys.path[:1] != [_TESTS]:
    sys.path.insert(0, _TESTS)
