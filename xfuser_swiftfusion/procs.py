"""Process liveness, shared by the shared-memory communicator and the network emulation."""
from __future__ import annotations

import os


def process_alive(pid: int) -> bool:
    """False if ``pid`` is gone or a zombie (a dead forked process nobody reaped yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")
