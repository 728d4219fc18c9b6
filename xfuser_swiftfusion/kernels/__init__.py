"""Local attention kernels with running softmax state.

Torus and ring attention compute several Q chunks against several K/V chunks that arrive at
different times; ``attend`` merges each partial result into the Q chunk's ``AttnState``
(layout [B, H, L, D]; output = acc / l, LSE = m + log l) and can finalize in the same call.
"""
from .dispatch import (BACKENDS, attend, attend_calls, current_backend, new_states, select_backend,
                       set_backend)
from .state import AttnState, merge_states, new_state

__all__ = [
    "AttnState",
    "BACKENDS",
    "attend",
    "attend_calls",
    "current_backend",
    "merge_states",
    "new_state",
    "new_states",
    "select_backend",
    "set_backend",
]
