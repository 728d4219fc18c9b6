"""The errors every communicator raises (``base`` re-exports them)."""
from __future__ import annotations


class CommTimeout(TimeoutError):
    """A wait, barrier or receive did not complete within the configured timeout."""


class PeerFailure(RuntimeError):
    """A peer rank died or reported an error while we depended on it."""


__all__ = ["CommTimeout", "PeerFailure"]
