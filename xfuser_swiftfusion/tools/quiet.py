"""Output a person reads: the result, not every rank's setup notices.

Two calls, shared by the ``swiftfusion`` command, the examples and the scripts:

- ``quiet_libraries()`` in the process a person starts, before xFuser and transformers are
  imported (both read their level once, at import: xFuser's ``LOG_LEVEL`` defaults to DEBUG).
  It also ignores the warnings that repeat once per rank or per call and that no user of ours
  can act on, and xFuser's "Using SDPA_FLASH as attention backend", logged whenever a runtime
  state is built (every rank, every strategy). Forked (emulated) ranks inherit all of it;
  torchrun ranks run the script, so they call it themselves.
- ``quiet_rank(rank)`` on every rank: our own warnings on rank 0 only, errors on every rank.

An explicit ``LOG_LEVEL`` / ``TRANSFORMERS_VERBOSITY`` / ``DIFFUSERS_VERBOSITY`` wins.
"""
from __future__ import annotations

import logging
import os
import warnings

import wrapt

# (category, message regex): each repeats per rank or per call and is not ours to fix
REPEATED_WARNINGS = (
    # torch 2.13 deprecates the collective xFuser 0.7.0 calls: once per rank
    (FutureWarning, r".*all_gather_into_tensor.* is deprecated"),
    # diffusers 0.42's sharding hooks gather outputs with it: once per rank and call
    (FutureWarning, r".*all_gather_tensor.* is deprecated"),
    # diffusers 0.42's load_config passes an argument huggingface_hub >= 1 ignores
    (UserWarning, r".*local_dir_use_symlinks.* is deprecated"),
)
RUNTIME_STATE = "xfuser.core.distributed.runtime_state"


def _quiet_runtime_state(module) -> None:
    # xFuser sets each module logger's level when the module executes: lower it afterwards
    logging.getLogger(module.__name__).setLevel(logging.ERROR)


def quiet_libraries() -> None:
    """Library defaults for a readable run; call before xFuser or transformers is imported
    (xFuser's runtime-state notice is silenced whenever that module loads)."""
    os.environ.setdefault("LOG_LEVEL", "warning")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    for category, message in REPEATED_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    wrapt.register_post_import_hook(_quiet_runtime_state, RUNTIME_STATE)  # at once if loaded


def quiet_rank(rank: int) -> None:
    """On every rank: ``quiet_libraries`` (a torchrun rank may not have called it), and our
    warnings on rank 0 only."""
    quiet_libraries()
    if rank != 0:
        logging.getLogger("xfuser.swiftfusion").setLevel(logging.ERROR)
