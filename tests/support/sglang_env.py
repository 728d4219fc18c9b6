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
modules skip with one line. Importing SGLang costs tens of seconds, so one child per test session
does it (``Child``, conftest's ``sglang_child`` fixture): it starts the way SGLang's worker
bootstrap does (platform, ``load_plugins()``, ``apply_plugin_hooks()``, with
``$SWIFTFUSION_STRATEGY`` set; ``Child.bootstrap`` is what it found), then restores SGLang's
attention and forgets the strategy, and runs test functions (``Child.run(jobs)``), one call at a
time. A job that raises returns its traceback (the child keeps serving); a job past its timeout
kills the child. SGLang wraps some CPU layers' ``forward_native`` (norms) in ``torch.compile``,
which every forked rank would compile again (tens of seconds each); the child runs them eagerly
(``TORCHDYNAMO_DISABLE=1``), the same arithmetic: the tests are about the attention calls.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import pickle
import select
import struct
import subprocess
import sys
import tempfile
import traceback
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


def _send(fd: int, obj) -> None:
    data = pickle.dumps(obj)
    data = struct.pack("<Q", len(data)) + data
    while data:
        data = data[os.write(fd, data):]


def _recv(fd: int, deadline: float | None = None):
    """One message from ``fd``; ``TimeoutError`` past ``deadline`` (monotonic), EOFError at end."""
    import time
    buf = b""
    need, header = 8, True
    while True:
        while len(buf) < need:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([fd], [], [], left)[0]:
                    raise TimeoutError
            chunk = os.read(fd, need - len(buf))
            if not chunk:
                raise EOFError
            buf += chunk
        if not header:
            return pickle.loads(buf)
        need, header, buf = struct.unpack("<Q", buf)[0], False, b""


ROOT = Path(__file__).resolve().parents[2]
PLUGIN_GROUP = "sglang.multimodal_gen.plugins"


def declared_entry_point() -> str:
    """Our entry point as pyproject.toml declares it."""
    import tomllib
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return data["project"]["entry-points"][PLUGIN_GROUP]["swiftfusion"]


def entry_point_site(folder: Path) -> Path:
    """``folder`` for PYTHONPATH, holding a distribution that declares our entry point unless
    the installed xfuser-swiftfusion already does (two plugins of one name make SGLang refuse
    all)."""
    from importlib import metadata
    if any(ep.name == "swiftfusion" for ep in metadata.entry_points(group=PLUGIN_GROUP)):
        return folder
    info = folder / "xfuser_swiftfusion_entry-0.0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: xfuser-swiftfusion-entry\n"
                                   "Version: 0.0\n")
    (info / "entry_points.txt").write_text(f"[{PLUGIN_GROUP}]\nswiftfusion = "
                                           f"{declared_entry_point()}\n")
    return folder


def worker_env(folder: Path, strategy: str | None) -> dict:
    """The environment of a fresh SGLang worker: our entry point declared, this tree first on
    the path, ``$SWIFTFUSION_STRATEGY`` as given (None: unset), no ``SGLANG_PLUGINS`` filter."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("SWIFTFUSION_STRATEGY", "SGLANG_PLUGINS")}
    env["PYTHONPATH"] = os.pathsep.join([str(entry_point_site(folder)), str(ROOT)])
    if strategy is not None:
        env["SWIFTFUSION_STRATEGY"] = strategy
    return env


# what runtime/managers/worker_bootstrap.py does before importing the GPU worker
def _bootstrap() -> dict:
    from sglang.multimodal_gen.runtime.platforms import initialize_current_platform
    initialize_current_platform()
    from sglang.multimodal_gen.runtime.platforms.plugins import apply_plugin_hooks, load_plugins
    load_plugins()
    apply_plugin_hooks()
    from xfuser_swiftfusion.integrations import sglang as sfs
    from xfuser_swiftfusion.integrations.sglang import config
    return {"installed": sfs.installed(), "strategy": config.current().strategy}


class Unavailable(RuntimeError):
    """SGLang's diffusion runtime does not import in the child (the one-line reason)."""


class Child:
    """One interpreter with SGLang imported, serving test functions for the session."""

    def __init__(self, env: dict | None = None, start_timeout_s: float = 600.0):
        import time
        tests = Path(__file__).resolve().parents[1]
        env = dict(os.environ if env is None else env)
        env.setdefault("TORCHDYNAMO_DISABLE", "1")  # see the module docstring
        self._log = tempfile.TemporaryFile()
        self._proc = subprocess.Popen([sys.executable, "-m", "support.sglang_env"], cwd=tests,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=self._log, env=env)
        try:
            status, value = _recv(self._proc.stdout.fileno(), time.monotonic() + start_timeout_s)
        except (TimeoutError, EOFError) as exc:
            self.close()
            raise RuntimeError(f"SGLang child did not start ({type(exc).__name__}):\n"
                               f"{self.log_tail()}") from None
        if status == "skip":
            self.close()
            raise Unavailable(value)
        self.bootstrap: dict = value  # what SGLang's plugin loading found in the fresh child

    def log_tail(self, chars: int = 6000) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-chars:]

    def run(self, jobs: list[tuple[str, str, tuple]], timeout_s: float = 900.0) -> list:
        """``module.function(*args)`` for each ``(module, function, args)`` of ``jobs`` (test
        modules and functions under tests/) in the child; their results in order. A job that
        raises fails the call with the child's traceback."""
        import time
        if self._proc.poll() is not None:
            raise RuntimeError(f"SGLang child has exited ({self._proc.returncode}):\n"
                               f"{self.log_tail()}")
        _send(self._proc.stdin.fileno(), jobs)
        try:
            status, value = _recv(self._proc.stdout.fileno(), time.monotonic() + timeout_s)
        except (TimeoutError, EOFError) as exc:
            self.close()
            what = (f"timed out after {timeout_s:.0f} s" if isinstance(exc, TimeoutError)
                    else "ended the child")
            raise RuntimeError(f"SGLang child: jobs {[j[:2] for j in jobs]} {what}:\n"
                               f"{self.log_tail()}") from None
        if status != "ok":
            raise RuntimeError(f"SGLang child job failed:\n{value}")
        return value

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._log.close()


def _child_main() -> None:
    # the protocol gets its own descriptors; fds 0 and 1 of this process and of the ranks it
    # forks are /dev/null and stderr, so nothing they print corrupts it
    inp, out = os.dup(0), os.dup(1)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    if absent():
        _send(out, ("skip", absent()))
        return
    install_torchvision_stub()
    report = _bootstrap()  # first, as in a fresh worker
    reason = sglang()
    if reason is not None:
        _send(out, ("skip", reason))
        return
    from xfuser_swiftfusion.integrations import sglang as sfs
    from xfuser_swiftfusion.integrations.sglang import config
    sfs.uninstall()  # jobs start from SGLang's own attention and install what they test
    os.environ.pop(config.STRATEGY_ENV, None)
    from . import sgl_kernel_cpu
    sgl_kernel_cpu.install()
    _send(out, ("ok", report))
    while True:
        try:
            jobs = _recv(inp)
        except EOFError:
            os._exit(0)  # the session is over; skip SGLang's slow interpreter teardown
        try:
            results = [getattr(importlib.import_module(m), f)(*args) for m, f, args in jobs]
            _send(out, ("ok", results))
        except BaseException:  # noqa: BLE001 - the traceback goes to the test
            _send(out, ("error", traceback.format_exc()))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    _child_main()
