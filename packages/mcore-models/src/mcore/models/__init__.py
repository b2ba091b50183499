"""GPT-family transformer models built from mcore.parallel modules and mcore.kernels ops."""

__version__ = "0.1.0"
