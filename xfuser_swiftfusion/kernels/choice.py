"""The measured kernel choice per GPU architecture.

``swiftfusion check --gpu-suite`` (its speed stage) times every backend of ``attend`` on the
launches a ``swiftfusion`` layer makes and writes ``kernel-table.json``: per architecture
(``"sm90"``) and input shape (``"128/bf16"``: head dim / dtype) the backends from fastest to
slowest, with the figures. Committed as ``choice_table.json`` beside this file (or named by
env ``SWIFTFUSION_KERNEL_TABLE``), it orders the automatic choice of ``attend`` on that
architecture: the first backend of the entry that can run a call's shape; backends the entry
does not list follow in the default order. Shapes and architectures the table has no entry
for keep the default order (``dispatch.AUTO_ORDER``).

File format (``FORMAT``)::

    {"format": "swiftfusion-kernel-table/1", "source": "<what measured it>",
     "archs": {"sm90": {"128/bf16": {"order": ["cudnn", "triton", "torch"],
                                     "ms": {"cudnn": 0.21, "triton": 0.25, "torch": 0.31}}}}}
"""
from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

FORMAT = "swiftfusion-kernel-table/1"
TABLE_ENV = "SWIFTFUSION_KERNEL_TABLE"
PACKAGED = Path(__file__).with_name("choice_table.json")
DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def arch_key(capability: tuple[int, int]) -> str:
    """``"sm90"`` for compute capability (9, 0)."""
    return f"sm{capability[0]}{capability[1]}"


def shape_key(head_dim: int, dtype: torch.dtype) -> str:
    """``"128/bf16"``: the entry of inputs of ``head_dim`` and ``dtype``."""
    return f"{head_dim}/{DTYPES.get(dtype, str(dtype).removeprefix('torch.'))}"


@dataclass(frozen=True)
class ChoiceTable:
    """A loaded table: ``orders[arch][shape]`` = backends, fastest first."""

    path: str
    source: str
    orders: Mapping[str, Mapping[str, tuple[str, ...]]]

    def order(self, capability: tuple[int, int], head_dim: int, dtype: torch.dtype) -> tuple[str, ...] | None:
        return self.orders.get(arch_key(capability), {}).get(shape_key(head_dim, dtype))


def parse_table(data: object, path: str, backends: Sequence[str]) -> ChoiceTable:
    """Check and load a table (see the module docstring); a ValueError names the file and the
    entry that is wrong."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"kernel table {path}: expected a JSON object with \"format\": \"{FORMAT}\"")
    archs = data.get("archs")
    if not isinstance(archs, dict):
        raise ValueError(f"kernel table {path}: \"archs\" must map architectures to entries")
    orders: dict[str, dict[str, tuple[str, ...]]] = {}
    for arch, entries in archs.items():
        if not isinstance(entries, dict):
            raise ValueError(f"kernel table {path}: {arch} must map shapes to entries")
        for shape, entry in entries.items():
            order = entry.get("order") if isinstance(entry, dict) else None
            if (not isinstance(order, list) or not order
                    or any(name not in backends for name in order)):
                raise ValueError(f"kernel table {path}: {arch} {shape}: \"order\" must be a "
                                 f"non-empty list of backends from {tuple(backends)}, got {order!r}")
            orders.setdefault(arch, {})[shape] = tuple(order)
    return ChoiceTable(path, str(data.get("source", "")), orders)


@functools.lru_cache(maxsize=None)
def _load(path: str, backends: tuple[str, ...]) -> ChoiceTable:
    with open(path) as f:
        return parse_table(json.load(f), path, backends)


def load_table(backends: Sequence[str]) -> ChoiceTable | None:
    """The table named by env ``SWIFTFUSION_KERNEL_TABLE``, else the packaged one, else None
    (no measurement yet). A named file that is missing or malformed is an error."""
    path = os.environ.get(TABLE_ENV)
    if path:
        if not os.path.exists(path):
            raise FileNotFoundError(f"{TABLE_ENV}={path}: no such kernel table")
        return _load(path, tuple(backends))
    return _load(str(PACKAGED), tuple(backends)) if PACKAGED.exists() else None


def clear_cache() -> None:
    """Forget loaded tables (tests; a table rewritten in this process)."""
    _load.cache_clear()


def table_entry(timings_ms: Mapping[str, float]) -> dict:
    """A table entry from the median milliseconds per backend of one shape: backends ordered
    fastest first, with the figures."""
    order = sorted(timings_ms, key=timings_ms.__getitem__)
    return {"order": order, "ms": {k: round(float(timings_ms[k]), 6) for k in order}}


def table_document(arch: str, entries: Mapping[str, Mapping[str, float]], source: str) -> dict:
    """The JSON document of a table for one architecture: ``entries[shape]`` = ms per backend."""
    return {"format": FORMAT, "source": source,
            "archs": {arch: {shape: table_entry(ms) for shape, ms in sorted(entries.items())}}}
