"""Sequence-parallel strategies: a registry of specs (``registry.py``), each building a callable
``(q, k, v, joint, scale) -> out`` under xFuser's USP contract.

| name          | mesh placement | transport                                   | from             |
|---------------|----------------|---------------------------------------------|------------------|
| usp           | usp            | xFuser's own USP (baseline, untouched)      | xFuser integration |
| tas           | tas            | all-to-all + two-sided ring, no overlap     | tas.py           |
| torus         | tas            | Torus stages, isend/irecv (NCCL / gloo)     | torus.py         |
| swiftfusion   | tas            | Torus stages, one-sided put/get + barriers  | swiftfusion.py   |
| auto          | chosen         | the cost model's pick per input shape       | auto.py          |
"""
from . import auto, swiftfusion, tas, torus  # noqa: F401  (each registers its spec)
from .registry import BuildArgs, Strategy, StrategySpec, get, names, register, specs

__all__ = ["BuildArgs", "Strategy", "StrategySpec", "get", "names", "register", "specs"]
