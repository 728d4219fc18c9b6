"""Which strategy SGLang's attention runs on: ``$SWIFTFUSION_STRATEGY`` or ``configure()``.

Unset, ``usp`` or ``sglang``: SGLang's own USP (the plugin changes nothing). ``swiftfusion``,
``torus``, ``tas``, ``auto``: that strategy, on the mesh this project chooses for the ranks'
machines (``$SWIFTFUSION_TOPOLOGY`` overrides the machines x GPUs read from the hostnames).
``$SWIFTFUSION_COMM``: the one-sided backend of ``swiftfusion`` (default ``auto``: NVSHMEM on
GPUs).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

STRATEGY_ENV = "SWIFTFUSION_STRATEGY"
COMM_ENV = "SWIFTFUSION_COMM"
STRATEGIES = ("swiftfusion", "torus", "tas", "auto")
OFF = ("", "usp", "sglang", "off", "none")


@dataclass
class Config:
    strategy: str | None          # None: SGLang's own USP
    comm: str = "auto"
    options: dict = field(default_factory=dict)


_override: list[Config] = []


def parse_strategy(name: str | None) -> str | None:
    """A strategy name, or None for SGLang's own USP; ``ValueError`` for an unknown one."""
    value = (name or "").strip().lower()
    if value in OFF:
        return None
    if value not in STRATEGIES:
        raise ValueError(f"{STRATEGY_ENV}={name!r}: SGLang runs one of {', '.join(STRATEGIES)} "
                         f"(or 'usp' for SGLang's own sequence parallelism)")
    return value


def configure(strategy: str | None, comm: str = "auto", options: dict | None = None) -> Config:
    """Set the strategy for this process (overrides the environment); None: from it again."""
    _override.clear()
    if strategy is not None:
        _override.append(Config(parse_strategy(strategy), comm, dict(options or {})))
    return current()


def current() -> Config:
    if _override:
        return _override[0]
    return Config(parse_strategy(os.environ.get(STRATEGY_ENV)),
                  os.environ.get(COMM_ENV, "auto") or "auto")
