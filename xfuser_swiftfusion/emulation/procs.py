"""Process liveness, shared by the shared-memory heap and the network emulation."""
from __future__ import annotations

import psutil


def process_alive(pid: int) -> bool:
    """False if ``pid`` is gone or a zombie (a dead forked process nobody reaped yet)."""
    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True
