"""Load a checkpoint's model weights: into this rank's parameters at any tp/pp layout, or as one whole model.

:func:`load_model` is the public way to get a ``GPTModel`` from an mcore checkpoint in one process::

    from mcore.train.checkpoint import load_model
    model = load_model("runs/my-run/checkpoints/latest")          # float32 on the CPU, in eval mode
    logits = model(tokens)                                        # [batch, seq, padded vocab]

:func:`load_model_weights` is what the :class:`~mcore.train.trainer.Trainer` (``weights=``) uses; it knows
parameters, names and process groups, not the trainer (so neither module imports the other).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from typing import Any

import torch

from mcore.models.gpt import GPTModel
from mcore.parallel.grid import ProcessGroups
from mcore.train.checkpoint.experts import expert_split, expert_tp, local_experts
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


def target_of(param: torch.Tensor, tp_size: int = 1, tp_rank: int = 0) -> Target:
    """The resharding target that ``param`` (a TP-local slice, the whole tensor at ``tp_size`` 1) represents at
    tensor-parallel rank ``tp_rank``: the checkpoint's tensor is cut (and its vocabulary padded) to match it."""
    meta = tensor_meta_of(param, tp_size)
    return Target(
        full_shape=meta.shape,
        partition_dim=meta.partition_dim,
        partition_blocks=meta.partition_blocks,
        tp_size=tp_size,
        tp_rank=tp_rank,
        vocab_padded_dim=meta.vocab_padded_dim,
        vocab_size=meta.vocab_size,
    )


def read_param(
    reader: CheckpointReader,
    name: str,
    param: torch.Tensor,
    groups: ProcessGroups,
    *,
    kind: str = "model",
    key: str | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """This rank's value of ``param`` (or, with ``kind="optim"`` and ``key``, of one of its optimizer states): its
    TP slice (etp for expert weights), and for an expert-parallel parameter its own experts' rows (see
    ``checkpoint.experts``)."""
    target = target_of(param, *expert_tp(param, groups))  # expert weights follow etp, the rest tp
    ep, _ = expert_split(param, groups)
    if ep > 1:  # read every expert of this TP slice, keep this ep rank's
        target = dataclasses.replace(target, full_shape=(target.full_shape[0] * ep, *target.full_shape[1:]))
    full = reader.read_local(name, target, kind=kind, key=key, dtype=dtype)
    return local_experts(full, param, groups)


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
        param.data.copy_(read_param(reader, name, param, groups, dtype=param.dtype))


def load_model(
    checkpoint: str | os.PathLike | CheckpointReader,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> GPTModel:
    """The whole model of an mcore checkpoint in this process, in eval mode.

    ``checkpoint``: a checkpoint directory, a directory whose ``latest`` names one (a run's ``checkpoints/``
    or the run directory itself), or an open :class:`CheckpointReader`. Any saved tp/pp layout is gathered;
    the embedding and output layer are re-padded to this model's padded vocabulary (``vocab_size`` rounded up
    to ``make_vocab_size_divisible_by``), so the logits have that many columns, of which the first
    ``vocab_size`` are real. Training checkpoints and model-only ones (from ``mcore-bridge convert``) load the
    same way; only the weights are read.
    """
    if isinstance(checkpoint, CheckpointReader):
        return _load_model(checkpoint, torch.device(device), dtype)
    with CheckpointReader(checkpoint) as reader:
        return _load_model(reader, torch.device(device), dtype)


def _load_model(reader: CheckpointReader, device: torch.device, dtype: torch.dtype) -> GPTModel:
    model = GPTModel(reader.model_config, params_dtype=dtype, device=device)
    named = [(name, param, model) for name, param in model.named_parameters()]
    load_model_weights(reader, named, reader.model_config, ProcessGroups.single())
    return model.eval()
