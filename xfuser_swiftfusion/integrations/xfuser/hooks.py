"""Post-import hooks for xFuser's modules.

``on_import(name, hook)``: ``hook(module)`` right after ``name`` executes (at once if it already
has): ``wrapt``'s post-import hooks. ``on_prefix_import(prefix, hook)``: after every module
whose name starts with ``prefix`` executes from now on, which wrapt cannot do (it hooks exact
names): a small ``sys.meta_path`` finder that wraps the loaders of matching modules.
Hooks must be idempotent.
"""
from __future__ import annotations

import importlib.abc
import sys
import threading
from types import ModuleType
from typing import Callable

import wrapt

Hook = Callable[[ModuleType], None]

_lock = threading.RLock()
_named: dict[str, list[Hook]] = {}
_prefixed: list[tuple[str, Hook]] = []


def on_import(name: str, hook: Hook) -> None:
    """Run ``hook(module)`` right after module ``name`` executes; registering the same hook
    twice is a no-op."""
    with _lock:
        hooks = _named.setdefault(name, [])
        if hook in hooks:
            return
        hooks.append(hook)
    wrapt.register_post_import_hook(hook, name)


class _PrefixLoader(importlib.abc.Loader):
    """Delegates to the real loader, then runs the prefix hooks on the executed module."""

    def __init__(self, loader) -> None:
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        for prefix, hook in tuple(_prefixed):
            if module.__name__.startswith(prefix):
                hook(module)

    def __getattr__(self, name):  # get_source, get_code, is_package, ... for inspect/pdb
        if name == "_loader":
            raise AttributeError(name)
        return getattr(self._loader, name)


class _PrefixFinder(importlib.abc.MetaPathFinder):
    """Finds matching modules through the other finders and wraps their loader."""

    def find_spec(self, fullname, path, target=None):
        if not any(fullname.startswith(prefix) for prefix, _ in _prefixed):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and not isinstance(spec.loader, _PrefixLoader):
                    spec.loader = _PrefixLoader(spec.loader)
                return spec
        return None


def on_prefix_import(prefix: str, hook: Hook) -> None:
    """Run ``hook(module)`` after every module named ``prefix...`` executes from now on
    (modules already imported are not revisited). Idempotent per (prefix, hook)."""
    with _lock:
        if (prefix, hook) not in _prefixed:
            _prefixed.append((prefix, hook))
        if not any(isinstance(f, _PrefixFinder) for f in sys.meta_path):
            sys.meta_path.insert(0, _PrefixFinder())


__all__ = ["on_import", "on_prefix_import"]
