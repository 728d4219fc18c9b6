"""Mutation testing of the core, on demand (never in CI): which one-token changes of a module
its covering fast tests notice.

    python scripts/mutation.py kernels/state.py            # one module (path under xfuser_swiftfusion/)
    python scripts/mutation.py --all                       # every configured module, in order
    python scripts/mutation.py kernels/state.py --list     # its mutants, nothing run
    python scripts/mutation.py kernels/state.py --only 12  # one mutant (its diff and test output)
    python scripts/mutation.py kernels/state.py --only 3,7 # some mutants (their diffs)

Configuration: ``[tool.swiftfusion.mutation]`` in pyproject.toml: per module the pytest
arguments of its covering tests and a time budget; ``equivalent``: mutants shown equivalent,
keyed by ``mutant key`` (below), each with its one-line reason; they are not run.

A mutant is one change of the module's syntax tree (``OPERATORS``): a comparison, arithmetic,
boolean or unary operator swapped or dropped, an int or float constant plus one, a bool
negated, ``break``/``continue`` swapped, a call statement deleted, or an element of a tuple
display returned (the value, tuples in it, branches of ``x if c else y``) deleted (a key such as ``planned.signature`` losing a part). Left alone: docstrings,
annotations, f-strings, ``raise`` statements, logging calls, numeric defaults of parameters and
lines marked ``# pragma: no mutate``. The key of a mutant is its line's text and the change
(``<stripped line> :: <what> #<n-th on the line>``): stable while that line is unchanged.

Each mutant is written into a copy of the tree (the package, tests, pyproject) under a
temporary directory, and the covering tests run there (``pytest -x -q``, one process,
``PYTHONPATH`` = the copy) in a child forked from a server that has imported torch once, in its
own session: a mutant whose tests run past ``timeout`` seconds (``timeout_factor`` x the
unmutated run + ``timeout_margin_s``) has its whole process group killed and counts as timed
out. A failing test run kills the mutant; a passing one means it survived. The unmutated tree
runs first and must pass. Results: a table on stdout and ``--json PATH`` (mutant keys,
lines, diffs, outcomes, seconds).
"""
from __future__ import annotations

import argparse
import ast
import copy
import json
import os
import shutil
import random
import signal
import sys
import tempfile
import time
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "xfuser_swiftfusion"

# operator swaps (ast node type -> replacement type)
COMPARE = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
           ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn,
           ast.NotIn: ast.In}
BINARY = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult,
          ast.FloorDiv: ast.Mult, ast.Mod: ast.FloorDiv, ast.Pow: ast.Mult,
          ast.LShift: ast.RShift, ast.RShift: ast.LShift, ast.BitAnd: ast.BitOr,
          ast.BitOr: ast.BitAnd, ast.BitXor: ast.BitAnd}
BOOLEAN = {ast.And: ast.Or, ast.Or: ast.And}
SYMBOL = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!=",
          ast.Is: "is", ast.IsNot: "is not", ast.In: "in", ast.NotIn: "not in", ast.Add: "+",
          ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%",
          ast.Pow: "**", ast.LShift: "<<", ast.RShift: ">>", ast.BitAnd: "&", ast.BitOr: "|",
          ast.BitXor: "^", ast.And: "and", ast.Or: "or", ast.Not: "not", ast.USub: "-",
          ast.Invert: "~"}
OPERATORS = ("compare", "binary", "boolean", "unary", "constant", "loop", "statement")
QUIET_CALLS = {"log_once", "debug", "info", "warning", "error", "exception", "warn", "print",
               "write"}  # calls whose deletion only changes what is logged


@dataclass
class Mutant:
    index: int
    line: int
    key: str       # "<stripped line> :: <what> #n"
    what: str      # e.g. "< -> <="
    source: str    # the mutated module's source
    outcome: str = "not run"  # killed | survived | timed out | equivalent | not run
    top: str = ""  # the top-level function or class holding it ("" at module level)
    seconds: float = 0.0
    note: str = ""

    def diff(self, original: str) -> str:
        a, b = original.splitlines(), self.source.splitlines()
        i = next((n for n, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        j = 0
        while j < min(len(a), len(b)) - i and a[-1 - j] == b[-1 - j]:
            j += 1
        return "\n".join([f"- {x}" for x in a[i:len(a) - j]] + [f"+ {y}" for y in b[i:len(b) - j]])


# --- generating mutants -----------------------------------------------------------------------

def _skipped_nodes(tree: ast.Module, lines: list[str]) -> set[int]:
    """ids of the nodes never mutated (module docstring rules)."""
    skip: set[int] = set()

    def drop(node: ast.AST | None) -> None:
        if node is not None:
            skip.update(id(n) for n in ast.walk(node))

    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and \
                isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            drop(body[0])  # docstring
        if isinstance(node, (ast.Raise, ast.JoinedStr, ast.Assert)):
            drop(node)
        elif isinstance(node, ast.AnnAssign):
            drop(node.annotation)
        elif isinstance(node, ast.arg):
            drop(node.annotation)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            drop(node.returns)
            for d in [*node.args.defaults, *node.args.kw_defaults]:
                if isinstance(d, ast.Constant) and type(d.value) in (int, float):
                    drop(d)
        elif isinstance(node, ast.Call) and _call_name(node) in QUIET_CALLS:
            drop(node)
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__"
                                                  for t in node.targets):
            drop(node)
        elif isinstance(node, ast.If) and isinstance(node.test, ast.Name) and \
                node.test.id == "TYPE_CHECKING":
            drop(node)
        lineno = getattr(node, "lineno", None)
        if lineno is not None and "pragma: no mutate" in lines[lineno - 1]:
            drop(node)
    return skip


def _call_name(call: ast.Call) -> str:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def _replace_segment(src_lines: list[str], node: ast.AST, text: str) -> str:
    """The module source with ``node``'s source segment replaced by ``text``."""
    l0, c0, l1, c1 = node.lineno - 1, node.col_offset, node.end_lineno - 1, node.end_col_offset
    # col offsets are in UTF-8 bytes
    first, last = src_lines[l0].encode(), src_lines[l1].encode()
    head, tail = first[:c0].decode(), last[c1:].decode()
    new = src_lines[:l0] + [head + text + tail] + src_lines[l1 + 1:]
    return "".join(new)


def _variants(node: ast.AST, returned: bool = False) -> list[tuple[str, ast.AST | str]]:
    """(what, replacement node or statement text) for one node (``returned``: a tuple
    display inside a ``return`` value)."""
    out: list[tuple[str, ast.AST | str]] = []
    if isinstance(node, ast.Compare):
        for i, op in enumerate(node.ops):
            new = COMPARE.get(type(op))
            if new:
                m = copy.deepcopy(node)
                m.ops[i] = new()
                out.append((f"{SYMBOL[type(op)]} -> {SYMBOL[new]}", m))
    elif isinstance(node, (ast.BinOp, ast.AugAssign)):
        new = BINARY.get(type(node.op))
        strs = isinstance(node, ast.BinOp) and any(
            isinstance(x, ast.JoinedStr) or (isinstance(x, ast.Constant) and isinstance(x.value, str))
            for x in (node.left, node.right))
        if new and not strs:
            m = copy.deepcopy(node)
            m.op = new()
            sym = "=" if isinstance(node, ast.AugAssign) else ""
            out.append((f"{SYMBOL[type(node.op)]}{sym} -> {SYMBOL[new]}{sym}", m))
    elif isinstance(node, ast.BoolOp):
        m = copy.deepcopy(node)
        m.op = BOOLEAN[type(node.op)]()
        out.append((f"{SYMBOL[type(node.op)]} -> {SYMBOL[type(m.op)]}", m))
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub, ast.Invert)):
        out.append((f"{SYMBOL[type(node.op)]}x -> x", node.operand))
    elif isinstance(node, ast.Constant):
        v = node.value
        if isinstance(v, bool):
            out.append((f"{v} -> {not v}", ast.Constant(not v)))
        elif isinstance(v, int):
            out.append((f"{v} -> {v + 1}", ast.Constant(v + 1)))
        elif isinstance(v, float):
            out.append((f"{v!r} -> {v + 1!r}", ast.Constant(v + 1)))
    elif isinstance(node, ast.Break):
        out.append(("break -> continue", "continue"))
    elif isinstance(node, ast.Continue):
        out.append(("continue -> break", "break"))
    elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) and \
            _call_name(node.value) not in QUIET_CALLS:
        out.append((f"{_call_name(node.value)}(...) deleted", "pass"))
    elif isinstance(node, ast.Tuple) and returned and len(node.elts) > 1:
        for i, e in enumerate(node.elts):
            m = copy.deepcopy(node)
            del m.elts[i]
            out.append((f"tuple element {i + 1} ({ast.unparse(e)}) deleted", m))
    return out


def _shape(value: ast.AST | None) -> list[ast.Tuple]:
    """The tuple displays that make up a returned value: the value itself, the tuples it holds
    and the branches of conditional expressions, recursively (not tuples inside calls,
    subscripts or comprehensions)."""
    if isinstance(value, ast.Tuple):
        return [value, *(t for e in value.elts for t in _shape(e))]
    if isinstance(value, ast.IfExp):
        return _shape(value.body) + _shape(value.orelse)
    return []


def mutants(path: Path) -> list[Mutant]:
    """Every mutant of the module at ``path`` (source order)."""
    original = path.read_text()
    tree = ast.parse(original)
    src_lines = original.splitlines(keepends=True)
    plain = [x.rstrip("\n") for x in src_lines]
    skip = _skipped_nodes(tree, plain)
    nodes = sorted((n for n in ast.walk(tree) if id(n) not in skip and hasattr(n, "lineno")),
                   key=lambda n: (n.lineno, n.col_offset, -n.end_lineno, -n.end_col_offset))
    out: list[Mutant] = []
    seen: dict[str, int] = {}
    dump = ast.dump(tree)
    returned = {id(t) for r in ast.walk(tree) if isinstance(r, ast.Return) for t in _shape(r.value)}
    tops = [(d.lineno, d.end_lineno, d.name) for d in tree.body
            if isinstance(d, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    for node in nodes:
        for what, repl in _variants(node, id(node) in returned):
            text = repl if isinstance(repl, str) else f"({ast.unparse(repl)})"
            source = _replace_segment(src_lines, node, text)
            try:
                if ast.dump(ast.parse(source)) == dump:
                    continue
                compile(source, str(path), "exec")
            except SyntaxError:
                continue
            stem = f"{plain[node.lineno - 1].strip()} :: {what}"
            seen[stem] = seen.get(stem, 0) + 1
            top = next((n for a, b, n in tops if a <= node.lineno <= b), "")
            out.append(Mutant(len(out), node.lineno, f"{stem} #{seen[stem]}", what, source, top=top))
    return out


# --- running ----------------------------------------------------------------------------------

def _copy_tree(dest: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache", "*.egg-info")
    for name in (PACKAGE, "tests", "scripts", "docs", "examples", "patches", "benchmarks"):
        if (ROOT / name).exists():
            shutil.copytree(ROOT / name, dest / name, ignore=ignore, symlinks=True)
    for f in ROOT.iterdir():
        if f.is_file():
            shutil.copy2(f, dest / f.name)


class Server:
    """Runs pytest in children forked from this process (torch imported once, here)."""

    def __init__(self, tree: Path, log: Path) -> None:
        import torch  # noqa: F401  (the children inherit it)
        import torch._dynamo  # noqa: F401
        import torch.distributed  # noqa: F401
        import pytest  # noqa: F401
        self.tree, self.log = tree, log

    def preload(self, args: list[str]) -> int:
        """Import here what collecting ``args`` imports besides the package and the tests
        (pytest plugins, hypothesis, numpy...), so that each child imports only the package
        and the test modules; the number of modules imported."""
        listing = self.log.with_suffix(".modules")
        pid = os.fork()
        if pid == 0:
            code = 99
            try:
                with open(os.devnull, "w") as null:
                    os.dup2(null.fileno(), 1)
                    os.dup2(null.fileno(), 2)
                os.chdir(self.tree)
                sys.path[:0] = [str(self.tree), str(self.tree / "tests")]
                import pytest
                code = pytest.main(["-q", "--co", "-p", "no:cacheprovider", *args])
                listing.write_text("\n".join(sorted(sys.modules)))
            finally:
                os._exit(int(code))
        os.waitpid(pid, 0)
        ours = (PACKAGE, "_" + PACKAGE, "test_", "support", "conftest", "__main__")
        names = [n for n in listing.read_text().split() if not n.startswith(ours)
                 and n not in sys.modules] if listing.exists() else []
        for name in names:
            try:
                __import__(name)
            except BaseException:  # noqa: BLE001  (a module that needs its importer's setup)
                pass
        for name in [n for n in sys.modules if n == PACKAGE or n.startswith(PACKAGE + ".")]:
            del sys.modules[name]  # the children import the package from their copy
        return len(names)

    @staticmethod
    def spawn(args: list[str], tree: Path, log: Path) -> int:
        """Fork a child running pytest with ``args`` in ``tree`` (its own session, output to
        ``log``); its pid."""
        pid = os.fork()
        if pid == 0:  # child: its own session, output to the log, pytest in the copy
            try:
                os.setsid()
                fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                os.chdir(tree)
                sys.path[:0] = [str(tree), str(tree / "tests")]
                os.environ["PYTHONPATH"] = str(tree)
                os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
                sys.dont_write_bytecode = True
                import pytest
                import torch
                torch.set_num_threads(1)
                code = pytest.main(["-x", "-q", "-p", "no:cacheprovider", *args])
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(int(code))
            except BaseException:  # noqa: BLE001
                import traceback
                traceback.print_exc()
                os._exit(99)
        return pid

    @staticmethod
    def poll(pid: int, start: float, timeout: float) -> tuple[str, float] | None:
        """('passed' | 'failed' | 'timed out', seconds) once the child ``pid`` is done (killed
        with its process group past ``timeout``), else None."""
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            code = os.waitstatus_to_exitcode(status)
            return ("passed" if code == 0 else "failed"), time.monotonic() - start
        if time.monotonic() - start > timeout:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)
            return "timed out", time.monotonic() - start
        return None

    def run(self, args: list[str], timeout: float) -> tuple[str, float]:
        """('passed' | 'failed' | 'timed out', seconds) of one run in the server's tree."""
        start = time.monotonic()
        pid = self.spawn(args, self.tree, self.log)
        while (result := self.poll(pid, start, timeout)) is None:
            time.sleep(0.05)
        return result


def load_config() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["swiftfusion"]["mutation"]


def run_module(module: str, conf: dict, server: Server, slots: list[tuple[Path, Path]],
               only: set[int] | None, budget: float | None, sample: int | None = None) -> tuple[list[Mutant], dict]:
    mconf = conf["modules"][module]
    args = mconf["tests"]
    budget = budget if budget is not None else mconf.get("budget_s", conf["budget_s"])
    src = ROOT / PACKAGE / module
    original = src.read_text()
    equivalent = conf.get("equivalent", {}).get(module, {})
    found = mutants(src)
    scope = mconf.get("scope")  # top-level names whose mutants run (all if absent)
    server.preload(args)
    outcome, base = server.run(args, conf["baseline_timeout_s"])
    if outcome != "passed":  # nothing of this module runs; the next module still does
        print(f"{module}: the unmutated tests do not pass ({outcome}):\n"
              + server.log.read_text()[-3000:], flush=True)
        found = []
    timeout = conf["timeout_factor"] * base + conf["timeout_margin_s"]
    print(f"{module}: {len(found)} mutants; tests {' '.join(args)}: {base:.1f} s unmutated, "
          f"timeout {timeout:.0f} s, budget {budget:.0f} s", flush=True)
    start = time.monotonic()
    todo = []
    for m in found:
        if only is not None and m.index not in only:
            continue
        if m.key in equivalent:
            m.outcome, m.note = "equivalent", equivalent[m.key]
            continue
        if scope is not None and m.top not in scope:
            m.note = "out of scope"  # stays "not run"
            continue
        todo.append(m)
    if sample is not None:  # a budget that may not reach the end then stops at a random sample
        random.Random(sample).shuffle(todo)
    free = list(slots)          # (tree, log) of the idle workers
    active: dict[int, tuple[Mutant, float, tuple[Path, Path]]] = {}
    try:
        while todo or active:
            while todo and free and (only is not None or time.monotonic() - start <= budget):
                m, slot = todo.pop(0), free.pop(0)
                (slot[0] / PACKAGE / module).write_text(m.source)
                active[server.spawn(args, *slot)] = (m, time.monotonic(), slot)
            if not active:
                break  # budget spent: the rest stay "not run"
            time.sleep(0.05)
            for pid, (m, t0, slot) in list(active.items()):
                result = server.poll(pid, t0, timeout)
                if result is None:
                    continue
                del active[pid]
                free.append(slot)
                m.outcome = {"passed": "survived", "failed": "killed"}.get(result[0], result[0])
                m.seconds = result[1]
                line = f"  #{m.index} L{m.line} {m.what}: {m.outcome} ({m.seconds:.1f} s)"
                if m.outcome == "survived" or only is not None:
                    line += "\n" + "\n".join("      " + x for x in m.diff(original).splitlines())
                print(line, flush=True)
                if only is not None and len(only) == 1:
                    print(Path(slot[1]).read_text()[-4000:])
    finally:
        for pid in active:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)
        for tree_, _ in slots:
            (tree_ / PACKAGE / module).write_text(original)
    counts = {k: sum(m.outcome == k for m in found)
              for k in ("killed", "survived", "timed out", "equivalent", "not run")}
    counts.update(mutants=len(found), seconds=round(time.monotonic() - start, 1),
                  baseline_s=round(base, 1))
    return found, counts


def score(c: dict) -> str:
    """Killed (timed out counted as killed) of the non-equivalent mutants that ran."""
    ran = c["killed"] + c["survived"] + c["timed out"]
    return f"{100 * (c['killed'] + c['timed out']) / ran:.0f} %" if ran else "-"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("modules", nargs="*", help="paths under xfuser_swiftfusion/ (pyproject's keys)")
    p.add_argument("--all", action="store_true", help="every configured module")
    p.add_argument("--list", action="store_true", help="list the mutants, run nothing")
    p.add_argument("--only", type=lambda x: {int(i) for i in x.split(",")},
                   help="run these mutant indices only (comma-separated; one module)")
    p.add_argument("--budget", type=float, help="seconds per module (overrides pyproject)")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--sample", type=int, metavar="SEED",
                   help="run the mutants in a random order (this seed): a budget that runs out "
                        "leaves a random sample run instead of the first lines")
    p.add_argument("-j", "--jobs", type=int, default=1,
                   help="mutants run at once, each in its own copy of the tree (default 1)")
    a = p.parse_args(argv)
    conf = load_config()
    modules = list(conf["modules"]) if a.all else a.modules
    unknown = [m for m in modules if m not in conf["modules"]]
    if not modules or unknown:
        p.error(f"name modules of [tool.swiftfusion.mutation.modules]: {', '.join(conf['modules'])}"
                + (f" (unknown: {', '.join(unknown)})" if unknown else ""))
    if a.list:
        for module in modules:
            eq = conf.get("equivalent", {}).get(module, {})
            for m in mutants(ROOT / PACKAGE / module):
                print(f"{module} #{m.index} L{m.line} {m.what}{'  [equivalent]' if m.key in eq else ''}"
                      f"\n    key: {json.dumps(m.key)}")
        return 0
    results = {}
    with tempfile.TemporaryDirectory(prefix="sf-mutation-") as tmp:
        slots = []
        for j in range(max(1, a.jobs)):
            tree = Path(tmp) / f"tree{j}"
            tree.mkdir()
            _copy_tree(tree)
            slots.append((tree, Path(tmp) / f"pytest{j}.log"))
        server = Server(*slots[0])
        for module in modules:
            found, counts = run_module(module, conf, server, slots, a.only, a.budget, a.sample)
            results[module] = {"counts": counts, "mutants": [
                {k: v for k, v in asdict(m).items() if k != "source"} | {"diff": m.diff((ROOT / PACKAGE / module).read_text())}
                for m in found]}
            if a.json:  # after each module: a run stopped later keeps the modules done
                a.json.write_text(json.dumps(results, indent=1))
    print("\n| module | mutants | killed | survived | equivalent | timed out | not run | killed of non-equivalent | time |")
    print("|---|---|---|---|---|---|---|---|---|")
    for module, r in results.items():
        c = r["counts"]
        print(f"| {module} | {c['mutants']} | {c['killed']} | {c['survived']} | {c['equivalent']} | "
              f"{c['timed out']} | {c['not run']} | {score(c)} | {c['seconds']:.0f} s |")
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
