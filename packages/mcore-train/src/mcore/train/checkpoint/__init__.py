"""mcore checkpoints: safetensors shards per (tp, pp) rank plus ``metadata.json``, resharded on load.

Public API:

- :func:`load_model` loads a checkpoint (any layout) into one ``GPTModel`` in this process;
- :class:`CheckpointReader` reads any checkpoint one tensor at a time (full or resharded);
- :class:`ModelCheckpointWriter` streams full tensors into a model-only checkpoint;
- :func:`resolve_checkpoint_dir` finds the checkpoint a path names (directly or through ``latest``);
- ``HF_ASSETS_DIR`` (``hf/``) holds a checkpoint's Hugging Face config and tokenizer files, which
  :func:`read_hf_assets` / :func:`write_hf_assets` carry from the checkpoint a run starts from to the ones it saves;
- :mod:`mcore.train.checkpoint.state` saves and loads the full training state of a ``Trainer`` (used by the loop).
"""

from mcore.train.checkpoint.format import HF_ASSETS_DIR, Layout, TensorMeta
from mcore.train.checkpoint.hf_assets import read_hf_assets, write_hf_assets
from mcore.train.checkpoint.model_weights import load_model
from mcore.train.checkpoint.model_writer import ModelCheckpointWriter, expected_model_tensors
from mcore.train.checkpoint.reader import CheckpointReader, resolve_checkpoint_dir
from mcore.train.errors import CheckpointError

__all__ = [
    "HF_ASSETS_DIR",
    "CheckpointError",
    "CheckpointReader",
    "Layout",
    "ModelCheckpointWriter",
    "TensorMeta",
    "expected_model_tensors",
    "load_model",
    "read_hf_assets",
    "resolve_checkpoint_dir",
    "write_hf_assets",
]
