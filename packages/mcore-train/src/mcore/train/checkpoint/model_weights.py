"""Load a checkpoint's model weights into this rank's parameters, at any tp/pp layout.

Used by the :class:`~mcore.train.trainer.Trainer` (``weights=``) and by the training-state loader; it knows
parameters, names and process groups, not the trainer (so neither module imports the other).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from mcore.parallel.grid import ProcessGroups
from mcore.train.checkpoint.format import tensor_meta_of
from mcore.train.checkpoint.reader import CheckpointReader
from mcore.train.checkpoint.resharding import Target
from mcore.train.errors import CheckpointError

# Fields that decide the model's tensor shapes and structure: a checkpoint must agree on all of them.
STRUCTURE_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "tie_word_embeddings",
    "attention_bias",
    "attention_out_bias",
    "mlp_bias",
    "qk_norm",
    "normalization",
)


def check_model_matches(reader: CheckpointReader, model_config: Any) -> None:
    """Raise :class:`CheckpointError` if the checkpoint's model differs in shape or structure."""
    saved = reader.model_config_dict
    current = model_config.to_dict()
    diffs = [
        f"{key}: checkpoint {saved.get(key)!r}, config {current.get(key)!r}"
        for key in STRUCTURE_FIELDS
        if key in saved and saved.get(key) != current.get(key)
    ]
    if diffs:
        raise CheckpointError(
            f"checkpoint {reader.path} was saved from a different model ({'; '.join(diffs)}); set the model "
            f"section to match the checkpoint (its metadata.json lists the model_config)"
        )


def target_of(param: torch.Tensor, groups: ProcessGroups) -> Target:
    """The resharding target that ``param`` (a TP-local slice) represents at this rank."""
    meta = tensor_meta_of(param, groups.tp_size)
    return Target(
        full_shape=meta.shape,
        partition_dim=meta.partition_dim,
        partition_blocks=meta.partition_blocks,
        tp_size=groups.tp_size,
        tp_rank=groups.tp_rank,
        vocab_padded_dim=meta.vocab_padded_dim,
        vocab_size=meta.vocab_size,
    )


@torch.no_grad()
def load_model_weights(
    reader: CheckpointReader,
    named_parameters: Iterable[tuple[str, torch.Tensor, Any]],
    model_config: Any,
    groups: ProcessGroups,
) -> None:
    """Copy the checkpoint's weights into the given (global name, parameter, chunk) triples, resharding from
    whatever layout the checkpoint was saved at."""
    check_model_matches(reader, model_config)
    known = set(reader.tensor_names())
    local = list(named_parameters)
    missing = sorted({name for name, _, _ in local if name not in known})
    if missing:
        raise CheckpointError(
            f"checkpoint {reader.path} lacks {len(missing)} tensor(s) this model needs, e.g. {missing[:3]}; "
            f"it was saved from a different model"
        )
    for name, param, _ in local:
        param.data.copy_(reader.read_local(name, target_of(param, groups), dtype=param.dtype))
