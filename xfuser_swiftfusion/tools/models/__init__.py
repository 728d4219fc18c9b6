"""Models for the examples and ``swiftfusion compare``: tiny real-architecture checkpoints
(``tiny``) and the sequence-parallel wrappers of the diffusers pipelines (``parallel``)."""
from .tiny import save_tiny_cogvideox, save_tiny_flux, tiny_checkpoint

__all__ = ["save_tiny_flux", "save_tiny_cogvideox", "tiny_checkpoint"]
