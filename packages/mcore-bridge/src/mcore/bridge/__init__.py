"""The ``mcore-bridge`` command line: Hugging Face <-> mcore checkpoint conversion."""

__version__ = "0.1.0"
