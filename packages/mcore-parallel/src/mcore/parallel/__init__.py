"""Tensor, sequence, pipeline and data parallelism on torch.distributed.

Process groups are built once from a ``ParallelConfig`` and passed explicitly to the modules that need them.
"""

__version__ = "0.1.0"
