"""Puts tests/ first on ``sys.path`` so that test modules import ``support`` (tests/support)
under any pytest import mode (scripts/fuzz.py and scripts/soak.py import it the same way), and
shares fixtures."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

_TESTS = str(Path(__file__).resolve().parent)
if sys.path[:1] != [_TESTS]:
    sys.path.insert(0, _TESTS)


@pytest.fixture(scope="module")
def tiny_checkpoint_cache(tmp_path_factory):
    """Tiny checkpoints written to a fresh ``$SWIFTFUSION_CACHE`` for the module."""
    mp = pytest.MonkeyPatch()
    mp.setenv("SWIFTFUSION_CACHE", str(tmp_path_factory.mktemp("cache")))
    yield
    mp.undo()


@pytest.fixture(scope="session")
def sglang_child(tmp_path_factory):
    """The session's one interpreter with SGLang imported (``support.sglang_env.Child``),
    started as SGLang's worker bootstrap starts a worker, with ``$SWIFTFUSION_STRATEGY=torus``
    and our entry point declared."""
    from support import sglang_env
    env = sglang_env.worker_env(tmp_path_factory.mktemp("sglang-entry"), "torus")
    try:
        child = sglang_env.Child(env)
    except sglang_env.Unavailable as exc:
        pytest.skip(str(exc))
    yield child
    child.close()
