"""Benchmark tooling (``python -m bench``): the five reference models (``models``), the timed
comparison of eager PyTorch, torch.compile and gemmfuse (``runner``), the GPU state sampler
(``gpu_monitor``), the charts (``plot``), and the model zoo (``zoo``: fourteen models;
``zoo_runner``, ``zoo_report``: ``python -m bench --zoo``). Nothing in the product package
imports it."""
from .runner import Config, run

__all__ = ["Config", "run"]
