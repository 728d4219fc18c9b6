"""SGLang in the CPU test environment.

``sglang`` 0.5.23 is installed with ``--no-deps`` beside the CPU torch (``scripts/
install_sglang_cpu.sh``). Its import chain for the diffusion runtime reaches ``torchvision``
through ``sglang.srt.configs`` (image processors of vision-language models the diffusion
runtime never calls), and PyPI's torchvision does not load beside torch 2.13+cpu (its C
operators are missing: "operator torchvision::nms does not exist"). ``import_sglang()`` lets
that chain import: where no working torchvision is importable it puts an inert stand-in on
``sys.meta_path`` whose names raise ``ImportError`` when used. Tests only: nothing a user
installs changes, and a working torchvision is always preferred.

The pytest process never imports SGLang (its import patches transformers process-wide, and it
puts the stand-in above on ``sys.meta_path``): ``absent()`` only looks for the package, so test
modules skip with one line, and ``in_child(jobs)`` runs test functions in one fresh interpreter
that imports SGLang (``sglang()``) and returns their results.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import pickle
import subprocess
import sys
import types
from pathlib import Path

_STUB = "torchvision"
_reason: list = []  # memo: [None] or [reason]


class _Missing(type):
    """A placeholder class: subclassable, attribute access yields more placeholders, calling
    it raises ``ImportError``."""

    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{cls.__qualname__}.{name}")

    def __call__(cls, *args, **kwargs):
        raise ImportError(f"{cls.__qualname__} needs torchvision, which the CPU test environment "
                          "does not load (tests/support/sglang_env.py)")


def _placeholder(name: str) -> type:
    return _Missing(name, (), {"__qualname__": name})


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{self.__name__}.{name}")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``torchvision`` and its submodules as inert stub packages."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == _STUB or fullname.startswith(_STUB + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__version__ = "0.0+stub"
        module.__swiftfusion_stub__ = True
        return module

    def exec_module(self, module):
        pass


def _torchvision_works() -> bool:
    if importlib.util.find_spec(_STUB) is None:
        return False
    try:
        importlib.import_module(_STUB)
        return True
    except Exception:
        for name in [m for m in sys.modules if m == _STUB or m.startswith(_STUB + ".")]:
            del sys.modules[name]
        return False


def install_torchvision_stub() -> bool:
    """Put the stand-in on ``sys.meta_path`` unless a working torchvision imports; True if
    installed (idempotent)."""
    if any(isinstance(f, _StubFinder) for f in sys.meta_path):
        return True
    if _torchvision_works():
        return False
    sys.meta_path.insert(0, _StubFinder())
    return True


def sglang() -> str | None:
    """None when SGLang's diffusion runtime imports here, else the one-line reason."""
    if _reason:
        return _reason[0]
    if importlib.util.find_spec("sglang") is None:
        _reason.append("sglang is not installed (scripts/install_sglang_cpu.sh)")
        return _reason[0]
    install_torchvision_stub()
    try:
        importlib.import_module("sglang.multimodal_gen.runtime.layers.attention.layer")
        _reason.append(None)
    except Exception as exc:  # a partial install: name the missing piece
        _reason.append(f"sglang's diffusion runtime does not import: {type(exc).__name__}: {exc}")
    return _reason[0]


def absent() -> str | None:
    """The one-line skip reason when SGLang is not installed (None: it is). Imports nothing."""
    if importlib.util.find_spec("sglang") is None:
        return "sglang is not installed (scripts/install_sglang_cpu.sh)"
    return None


def in_child(jobs: list[tuple[str, str, tuple]], timeout_s: float = 900.0) -> list:
    """Run ``module.function(*args)`` for each ``(module, function, args)`` of ``jobs`` (test
    modules and functions under tests/) in one fresh interpreter with SGLang imported; return
    their results in order. A job that raises fails the call with the child's traceback."""
    tests = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-m", "support.sglang_env"], cwd=tests,
                          input=pickle.dumps(jobs), capture_output=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"SGLang child process failed (exit {done.returncode}):\n"
                           f"{done.stderr.decode(errors='replace')[-6000:]}")
    return pickle.loads(done.stdout)


def _child_main() -> None:
    jobs = pickle.loads(sys.stdin.buffer.read())
    out = sys.stdout.buffer
    sys.stdout = sys.stderr  # prints of the jobs must not corrupt the pickled results
    reason = sglang()
    if reason is not None:
        raise SystemExit(reason)
    results = []
    for module, function, args in jobs:
        results.append(getattr(importlib.import_module(module), function)(*args))
    out.write(pickle.dumps(results))
    out.flush()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    _child_main()
