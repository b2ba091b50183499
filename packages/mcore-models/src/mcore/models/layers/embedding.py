"""Vocab-parallel input embedding and output layer, with the vocabulary padded to a multiple of 128 x tp.

Padding rows are initialised to zero and tagged (``vocab_padded_dim = 0``, ``vocab_size``); they never
enter the loss (``valid_vocab_size``) and ``mask_padded_logits`` sets their logits to ``-inf``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mcore.models.config import TransformerConfig
from mcore.parallel.param_attrs import mark_vocab_padded
from mcore.parallel.tensor_parallel import ColumnParallelLinear, VocabParallelEmbedding


@dataclass(frozen=True)
class PaddedVocabInit:
    """``init_method(full_weight, generator)``: Normal(0, std) rows for the real vocabulary, zero padding rows.

    The real rows are drawn as a tensor of their own shape, so they do not depend on how much padding a
    given tp adds (the padded size is a multiple of 128 x tp).
    """

    std: float
    vocab_size: int

    def __call__(self, weight: torch.Tensor, generator: torch.Generator | None = None) -> None:
        if weight.shape[0] < self.vocab_size:
            raise ValueError(f"padded vocab weight has {weight.shape[0]} rows, fewer than vocab_size {self.vocab_size}")
        with torch.no_grad():
            weight.zero_()
            weight[: self.vocab_size].normal_(0.0, self.std, generator=generator)


def build_embedding(
    config: TransformerConfig,
    padded_vocab_size: int,
    *,
    tp_group=None,
    sequence_parallel: bool = False,
    params_dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> VocabParallelEmbedding:
    """Token embedding ``[V_pad/tp, h]`` per rank; fed ``[s, b]`` ids it returns ``[s(/tp), b, h]``."""
    return VocabParallelEmbedding(
        padded_vocab_size,
        config.hidden_size,
        tp_group=tp_group,
        sequence_parallel=sequence_parallel,
        init_method=PaddedVocabInit(config.initializer_range, config.vocab_size),
        vocab_size=config.vocab_size,
        params_dtype=params_dtype,
        device=device,
    )


def build_output_layer(
    config: TransformerConfig,
    padded_vocab_size: int,
    *,
    tied_weight: torch.nn.Parameter | None = None,
    tp_group=None,
    sequence_parallel: bool = False,
    params_dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> ColumnParallelLinear:
    """The LM head: ``[s, b, h] -> [s, b, V_pad/tp]`` vocab-sharded logits (never gathered).

    With ``tied_weight`` (the embedding's Parameter) the layer multiplies by that very Parameter and owns
    no weight of its own (it is built on the meta device, so nothing is allocated or drawn for it).
    """
    output = ColumnParallelLinear(
        config.hidden_size,
        padded_vocab_size,
        tp_group=tp_group,
        bias=False,
        gather_output=False,
        sequence_parallel=sequence_parallel,
        init_method=PaddedVocabInit(config.initializer_range, config.vocab_size),
        params_dtype=params_dtype,
        device="meta" if tied_weight is not None else device,
    )
    if tied_weight is not None:
        output.weight = tied_weight
    else:
        mark_vocab_padded(output.weight, 0, config.vocab_size)
    return output


def mask_padded_logits(logits: torch.Tensor, vocab_size: int, tp_rank: int) -> torch.Tensor:
    """Set, in place, the logits of padding columns in this rank's vocab shard to ``-inf``; return them.

    Padding rows hold zero weights, so their logits are 0 and could outrank every real token.
    """
    local = logits.shape[-1]
    first_padded = vocab_size - tp_rank * local
    if first_padded < local:
        logits[..., max(first_padded, 0) :] = float("-inf")
    return logits
