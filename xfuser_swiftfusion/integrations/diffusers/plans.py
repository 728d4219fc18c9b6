"""The ``_cp_plan`` a model is sharded with: its own, plus fixes for gaps in diffusers' plans.

LTX-2 (diffusers 0.42): the plan splits the video RoPE (``rope``) but not the video RoPE of
the audio<->video cross-attention (``cross_attn_rope``), so with context parallelism the
cross-attention applies full-length rotary tables to local queries and the forward fails
(with diffusers' own templated attention too). Its outputs are split like ``rope``'s.
"""
from __future__ import annotations

import logging

import torch

from ...log import get_logger, log_once

logger = get_logger(__name__)


def _ltx2_fix(model: torch.nn.Module, plan: dict) -> dict:
    from diffusers.models._modeling_parallel import ContextParallelInput
    if "cross_attn_rope" in plan or not hasattr(model, "cross_attn_rope") or "rope" not in plan:
        return plan
    split = ContextParallelInput(split_dim=1, expected_dims=3, split_output=True)
    log_once(logger, "plan-fix-ltx2", f"{type(model).__name__}: its _cp_plan does not split "
             "cross_attn_rope (the video RoPE of audio<->video cross-attention); splitting its "
             "outputs like rope's", logging.INFO)
    return {**plan, "cross_attn_rope": {0: split, 1: split}}


# class name -> fix(model, plan) -> plan
FIXES = {"LTX2VideoTransformer3DModel": _ltx2_fix}


def plan_for(model: torch.nn.Module, cp_plan: dict | None = None) -> dict:
    """``cp_plan`` if given (used as is), else the model's ``_cp_plan`` with its fix applied;
    ``ValueError`` if there is none."""
    if cp_plan is not None:
        return cp_plan
    plan = getattr(model, "_cp_plan", None)
    if plan is None:
        raise ValueError(f"{type(model).__name__} has no _cp_plan (diffusers' context-parallel "
                         "sharding plan); pass cp_plan=")
    fix = FIXES.get(type(model).__name__)
    return fix(model, plan) if fix is not None else plan


__all__ = ["FIXES", "plan_for"]
