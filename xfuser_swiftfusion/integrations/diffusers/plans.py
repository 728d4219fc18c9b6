"""The ``_cp_plan`` a model is sharded with: its own, fitted to the model, plus fixes for gaps
in diffusers' plans; and the attention modules whose tokens the plan leaves whole.

Fitting: a plan key names modules by path (``blocks.3.attn1``; ``*`` = every element of a
``ModuleList``). diffusers' plans hard-code block counts (Helios: blocks 0-39), so a model
built with fewer blocks fails in diffusers with "'2' is not a submodule of 'ModuleList'".
``fit_to_model`` drops the entries whose block index lies beyond the model's blocks (logged
once) and refuses, naming plan and model, a key that names a module the model does not have.

LTX-2 (diffusers 0.42): the plan splits the video RoPE (``rope``) but not the video RoPE of
the audio<->video cross-attention (``cross_attn_rope``), so with context parallelism the
cross-attention applies full-length rotary tables to local queries and the forward fails
(with diffusers' own templated attention too). Its outputs are split like ``rope``'s.

``REPLICATED``: per model class, the attention modules whose queries or keys/values are not
split (``sites.Site``); read from each model's forward in diffusers 0.42.
"""
from __future__ import annotations

import logging

import torch

from ...log import get_logger, log_once
from .sites import Site

logger = get_logger(__name__)

_WHOLE = Site(query_sharded=False, kv_sharded=False)
REPLICATED: dict[str, dict[str, Site]] = {
    # LTX-2: audio latents and the audio prompt are not in the plan (video and its text are)
    "LTX2VideoTransformer3DModel": {
        "transformer_blocks.*.audio_attn1": _WHOLE,                  # audio self-attention
        "transformer_blocks.*.audio_attn2": _WHOLE,                  # audio -> audio prompt
        "transformer_blocks.*.audio_to_video_attn":                  # video -> audio
            Site(query_sharded=True, kv_sharded=False),
        "transformer_blocks.*.video_to_audio_attn":                  # audio -> video
            Site(query_sharded=False, kv_sharded=True),
    },
    # MiniMax-H3: the text refiner runs before the plan splits the packed sequence
    "MiniMaxH3Transformer3DModel": {"token_refiner.refiner_blocks.*.attn": _WHOLE},
}


class PlanError(ValueError):
    """A plan key that names a module the model does not have."""


class _Beyond(Exception):
    """A plan key whose block index lies beyond its ``ModuleList``."""

    def __init__(self, path: str, length: int):
        super().__init__(path)
        self.path, self.length = path, length


def modules_named(model: torch.nn.Module, key: str) -> list[torch.nn.Module]:
    """The modules a plan key names (``""``: the model; ``*``: every element of a
    ``ModuleList``), as diffusers' ``_find_submodule_by_name`` resolves them; ``PlanError``
    or ``_Beyond`` where the model has no such module."""
    found, done = [model], []
    for atom in key.split(".") if key else []:
        nxt = []
        for module in found:
            if atom == "*":
                if not isinstance(module, torch.nn.ModuleList):
                    raise PlanError(f"'*' after {'.'.join(done) or '<model>'}, which is a "
                                    f"{type(module).__name__}, not a ModuleList")
                nxt.extend(module)
            elif atom.isdigit() and isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)):
                if int(atom) >= len(module):
                    raise _Beyond(".".join(done), len(module))
                nxt.append(module[int(atom)])
            elif isinstance(getattr(module, atom, None), torch.nn.Module):
                nxt.append(getattr(module, atom))
            else:
                raise PlanError(f"{'.'.join(done) or '<model>'} ({type(module).__name__}) has no "
                                f"submodule {atom!r}")
        found = nxt
        done.append(atom)
    return found


def fit_to_model(model: torch.nn.Module, plan: dict, what: str = "_cp_plan") -> dict:
    """``plan`` without the keys whose block index lies beyond the model's blocks (logged
    once); ``PlanError`` naming ``what``, the model and the key for any other missing module."""
    name = type(model).__name__
    kept, dropped = {}, {}
    for key, entry in plan.items():
        try:
            modules_named(model, key)
        except _Beyond as beyond:
            dropped.setdefault((beyond.path, beyond.length), []).append(key)
            continue
        except PlanError as exc:
            raise PlanError(f"{name}'s {what} names {key!r}, but {exc}; pass cp_plan= with "
                            f"{name}'s module names") from None
        kept[key] = entry
    for (path, length), keys in dropped.items():
        log_once(logger, f"plan-trim-{name}-{path}-{length}-{len(keys)}",
                 f"{name}: its {what} names {len(keys)} entries beyond the {length} modules of "
                 f"{path} (e.g. {keys[0]!r}); the plan is trimmed to the model", logging.INFO)
    return kept


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
    """``cp_plan`` if given, else the model's ``_cp_plan`` with its fix applied, fitted to the
    model (``fit_to_model``); ``ValueError`` if there is none."""
    if cp_plan is not None:
        return fit_to_model(model, cp_plan, "cp_plan")
    plan = getattr(model, "_cp_plan", None)
    if plan is None:
        raise ValueError(f"{type(model).__name__} has no _cp_plan (diffusers' context-parallel "
                         "sharding plan); pass cp_plan=")
    fix = FIXES.get(type(model).__name__)
    return fit_to_model(model, fix(model, plan) if fix is not None else plan)


def replicated_sites(model: torch.nn.Module) -> dict[torch.nn.Module, Site]:
    """The attention modules of ``model`` whose tokens the plan leaves whole, with their
    ``Site`` (``REPLICATED``; entries the model lacks are skipped: its plan lacks them too)."""
    out: dict[torch.nn.Module, Site] = {}
    for key, site in REPLICATED.get(type(model).__name__, {}).items():
        try:
            out.update(dict.fromkeys(modules_named(model, key), site))
        except (PlanError, _Beyond):
            continue
    return out


__all__ = ["FIXES", "PlanError", "REPLICATED", "fit_to_model", "modules_named", "plan_for",
           "replicated_sites"]
