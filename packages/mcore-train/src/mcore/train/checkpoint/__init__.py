"""mcore checkpoints: safetensors shards per (tp, pp) rank plus ``metadata.json``, resharded on load.

Public API:

- :class:`CheckpointReader` reads any checkpoint one tensor at a time (full or resharded);
- :class:`ModelCheckpointWriter` streams full tensors into a model-only checkpoint;
- :func:`resolve_checkpoint_dir` finds the checkpoint a path names (directly or through ``latest``);
- :mod:`mcore.train.checkpoint.state` saves and loads the full training state (used by the loop).
"""

from mcore.train.checkpoint.format import Layout, TensorMeta
from mcore.train.checkpoint.model_writer import ModelCheckpointWriter, expected_model_tensors
from mcore.train.checkpoint.reader import CheckpointReader, resolve_checkpoint_dir
from mcore.train.errors import CheckpointError

__all__ = [
    "CheckpointError",
    "CheckpointReader",
    "Layout",
    "ModelCheckpointWriter",
    "TensorMeta",
    "expected_model_tensors",
    "resolve_checkpoint_dir",
]
