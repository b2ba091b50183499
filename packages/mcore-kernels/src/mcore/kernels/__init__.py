"""Fused GPU ops with pure-torch references.

Every public op runs on any device: on CUDA it dispatches to a Triton kernel, elsewhere to the
torch reference (``MCORE_KERNELS_BACKEND=reference|triton`` or the ``backend=`` keyword override it).
"""

__version__ = "0.1.0"
