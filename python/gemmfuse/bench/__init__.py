"""Benchmark tooling (``gemmfuse bench``): the five reference models (``models``), the timed
comparison of eager PyTorch, torch.compile and gemmfuse (``runner``), the GPU state sampler
(``gpu_monitor``) and the charts (``plot``). Nothing in the product package imports it."""
from .runner import Config, run

__all__ = ["Config", "run"]
