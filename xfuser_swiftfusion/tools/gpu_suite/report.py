"""Rows of the GPU suite: one per check, written as JSON lines as they are produced (so a stage
that crashes keeps what it finished) and printed as one table at the end."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

RESULTS = ("PASS", "FAIL", "SKIP", "INFO")


@dataclass
class Row:
    """``result``: PASS / FAIL (a check with a criterion), SKIP (cannot run here: ``figure``
    says why), INFO (a measurement or a probe without a criterion). ``figure``: the one line a
    person reads; ``data``: every number behind it."""

    stage: str
    case: str
    result: str
    figure: str = ""
    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.result not in RESULTS:
            raise ValueError(f"result {self.result!r} is not one of {RESULTS}")


class RowWriter:
    """Appends rows to a JSON-lines file, one flushed line per row."""

    def __init__(self, path: str, stage: str) -> None:
        self.path, self.stage = path, stage

    def add(self, case: str, result: str, figure: str = "", **data: Any) -> Row:
        row = Row(self.stage, case, result, figure, data)
        with open(self.path, "a") as f:
            f.write(json.dumps(asdict(row), default=str) + "\n")
        return row

    def check(self, case: str, passed: bool, figure: str, **data: Any) -> Row:
        return self.add(case, "PASS" if passed else "FAIL", figure, **data)


def read_rows(path: str) -> list[Row]:
    """Rows of a JSON-lines file (none if it does not exist)."""
    try:
        with open(path) as f:
            return [Row(**json.loads(line)) for line in f if line.strip()]
    except FileNotFoundError:
        return []


def format_table(rows: list[Row]) -> str:
    """Markdown table: stage, case, result, figure."""
    lines = ["| stage | case | result | figure |", "| --- | --- | --- | --- |"]
    for r in rows:
        figure = r.figure.replace("|", "/").replace("\n", " ")
        lines.append(f"| {r.stage} | {r.case} | {r.result} | {figure} |")
    return "\n".join(lines)


def summary(rows: list[Row]) -> str:
    counts = {k: sum(r.result == k for r in rows) for k in RESULTS}
    return ", ".join(f"{n} {k}" for k, n in counts.items() if n)
