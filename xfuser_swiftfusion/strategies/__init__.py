"""Sequence-parallel strategies, each a callable ``(q, k, v, joint) -> out`` (USP contract).

| name          | mesh placement | transport                                   |
|---------------|----------------|---------------------------------------------|
| usp           | usp            | xFuser's own USP (baseline, untouched)      |
| tas           | tas            | all-to-all + two-sided ring, no overlap     |
| torus         | tas            | Torus stages, isend/irecv (NCCL / gloo)     |
| swiftfusion   | tas            | Torus stages, one-sided put/get + barriers  |
| auto          | chosen         | the cost model's pick per input shape       |
"""
STRATEGIES = ("usp", "tas", "torus", "swiftfusion", "auto")
