"""Logging through xFuser's logger hierarchy.

Our loggers are children of xFuser's root logger ``"xfuser"`` (``xfuser.swiftfusion.<module>``),
so they use xFuser's handlers and ``LOG_LEVEL`` once xFuser is imported, without importing it
(``import xfuser`` takes seconds).
"""
from __future__ import annotations

import logging

_seen: set[str] = set()


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger("xfuser.swiftfusion." + name.removeprefix("xfuser_swiftfusion."))


def log_once(logger: logging.Logger, key: str, msg: str, level: int = logging.WARNING) -> None:
    """Log ``msg`` the first time ``key`` is seen in this process."""
    if key not in _seen:
        _seen.add(key)
        logger.log(level, msg, stacklevel=2)
