"""Layers point one way: no import cycle (function-level imports included), the core imports
nothing of xFuser, diffusers, the emulation, the integrations or the tools, importing the
package has no side effects, and no strategy name is compared outside the registry."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "xfuser_swiftfusion"
ROOT = "xfuser_swiftfusion"
UPPER = ("integrations", "emulation", "tools")  # everything else in the package is the core
# ("auto" also names the kernel and communicator defaults, so it is not checked)
STRATEGY_NAMES = ("usp", "tas", "torus", "swiftfusion")


def _module(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules=frozenset()) -> set[str]:
    """Every module ``path`` imports, at any depth of its code (absolute names); ``from pkg
    import name`` counts ``pkg.name`` where that is one of ``modules``, else ``pkg``."""
    mod = _module(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            name = f"{base}.{node.module}" if node.level and node.module else (
                base if node.level else node.module)
            subs = {f"{name}.{a.name}" for a in node.names} & set(modules)
            out |= subs if len(subs) == len(node.names) else subs | {name}
    return out


def _graph() -> dict[str, set[str]]:
    files = {_module(p): p for p in PKG.rglob("*.py")}
    return {m: {i for i in _imports(p, files) if i in files and i != m} for m, p in files.items()}


def _is_core(mod: str) -> bool:
    parts = mod.split(".")
    return len(parts) < 2 or parts[1] not in UPPER and parts[1] != "__main__"


def test_no_import_cycle():
    graph = _graph()
    # a package's __init__ importing its own submodules is not a cycle through that package
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycle = stack[stack.index(n):] + [n]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_the_cycle_check_can_fail(tmp_path, monkeypatch):
    """The graph above sees function-level and relative imports."""
    (tmp_path / "a.py").write_text("def f():\n    from .b import g\n")
    (tmp_path / "b.py").write_text("from . import a\n")
    monkeypatch.setattr(sys.modules[__name__], "PKG", tmp_path)
    graph = _graph()
    assert f"{tmp_path.name}.b" in graph[f"{tmp_path.name}.a"]
    assert f"{tmp_path.name}.a" in graph[f"{tmp_path.name}.b"]


def test_core_imports_nothing_above_it():
    bad = []
    for path in PKG.rglob("*.py"):
        mod = _module(path)
        if not _is_core(mod):
            continue
        for name in _imports(path):
            top = name.split(".")[0]
            upper = name.startswith(ROOT + ".") and not _is_core(name)
            if top in ("xfuser", "diffusers", "yunchang", "transformers") or upper:
                bad.append(f"{mod} imports {name}")
    assert not bad, "\n".join(bad)


def test_import_has_no_side_effects():
    code = ("import sys; before = list(sys.meta_path); import xfuser_swiftfusion; "
            "assert sys.meta_path == before, sys.meta_path; "
            "loaded = [m for m in ('xfuser', 'diffusers', 'yunchang') if m in sys.modules]; "
            "assert not loaded, loaded")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]


def _string_compares(tree: ast.AST) -> list[int]:
    """Lines comparing something with a strategy-name literal (==, !=, in, not in)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            consts = [c for c in [node.left, *node.comparators] if isinstance(c, ast.Constant)]
            for c in [node.left, *node.comparators]:
                if isinstance(c, (ast.Tuple, ast.List, ast.Set)):
                    consts += [e for e in c.elts if isinstance(e, ast.Constant)]
            if any(c.value in STRATEGY_NAMES for c in consts):
                lines.append(node.lineno)
    return lines


def test_no_strategy_name_comparison_outside_the_registry():
    """Placement literals ("usp"/"tas" as a mesh placement) live in mesh.py and groups; every
    other module asks a strategy's spec."""
    allowed = {"strategies/registry.py", "mesh.py"}
    bad = []
    for path in PKG.rglob("*.py"):
        rel = str(path.relative_to(PKG))
        if rel in allowed:
            continue
        bad += [f"{rel}:{n}" for n in _string_compares(ast.parse(path.read_text()))]
    assert not bad, "strategy names compared in: " + ", ".join(bad)
    assert _string_compares(ast.parse("x = s == 'torus' or s in ('usp', 'tas')")) == [1, 1]
