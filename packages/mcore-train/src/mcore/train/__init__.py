"""The ``mcore-train`` command line: configuration, data, training loop, checkpoints and metrics."""

__version__ = "0.1.0"
