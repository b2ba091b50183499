"""The run's tokenizer and datasets, chosen by the ``data`` section of the config."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from mcore.train.config import Config
from mcore.train.data import (
    DatasetSplits,
    EmptySplitError,
    build_data_loader,
    build_gpt_datasets,
    build_mock_datasets,
    embedded_corpus_dataset,
)
from mcore.train.errors import UserError
from mcore.train.tokenizer import ByteTokenizer, load_tokenizer


@dataclass
class RunData:
    """Tokenizer and datasets of a run; ``valid`` is ``None`` when evaluation is off."""

    tokenizer: Any
    train: torch.utils.data.Dataset | None
    valid: torch.utils.data.Dataset | None


def num_valid_samples(config: Config) -> int:
    """One fixed validation set, evaluated whole at every evaluation: ``eval_steps`` global batches."""
    if config.train.eval_interval == 0 or config.train.eval_steps == 0:
        return 0
    return config.train.eval_steps * config.train.global_batch_size


def build_run_data(config: Config, *, for_training: bool = True) -> RunData:
    """Load the tokenizer and build the datasets; bad paths raise :class:`UserError`.

    ``for_training=False`` builds only the validation split (for ``mcore-train evaluate``).
    """
    data = config.data
    tokenizer = load_tokenizer(data.tokenizer)
    if tokenizer.vocab_size > config.model.vocab_size:
        raise UserError(
            f"tokenizer {data.tokenizer!r} has {tokenizer.vocab_size} tokens but model.vocab_size is "
            f"{config.model.vocab_size}; set model.vocab_size >= {tokenizer.vocab_size}"
        )
    if for_training:
        counts = (config.train.steps * config.train.global_batch_size, num_valid_samples(config), 0)
    else:
        counts = (0, config.train.eval_steps * config.train.global_batch_size, 0)
    common = dict(seq_length=data.seq_length, num_samples=counts, seed=config.train.seed)
    try:
        splits = _build_splits(config, tokenizer, common)
    except EmptySplitError as exc:
        raise UserError(_empty_split_message(config, exc, for_training)) from None
    return RunData(tokenizer=tokenizer, train=splits.train, valid=splits.valid)


def _empty_split_message(config: Config, exc: EmptySplitError, for_training: bool) -> str:
    """What ``data.split`` left empty and the config keys that fix it."""
    split = config.data.split
    if exc.split_name == "valid":
        fix = "give the validation part a share, e.g. data.split='95,5,0'"
        if for_training:
            fix += ", or turn evaluation off with train.eval_interval=0"
        what = "evaluation needs train.eval_steps x train.global_batch_size samples"
    else:
        fix = f"give the {exc.split_name} part a share, e.g. data.split='95,5,0'"
        what = f"{exc.split_name} samples were asked for"
    return f"data.split={split!r} leaves no {exc.split_name} documents in {exc.corpus!r} but {what}; {fix}"


def _build_splits(config: Config, tokenizer: Any, common: dict[str, Any]) -> DatasetSplits:
    data = config.data
    if data.mock:
        # Mock tokens span the model's whole vocabulary, as real data for that vocabulary would.
        mock_vocab = config.model.vocab_size
        splits: DatasetSplits = build_mock_datasets(vocab_size=mock_vocab, packing=data.packing, **common)
    elif data.path is None:
        if not isinstance(tokenizer, ByteTokenizer):
            raise UserError(
                f"the embedded corpus is tokenized with the byte tokenizer; data.tokenizer={data.tokenizer!r} needs "
                f"data.path (a preprocessed .bin/.idx prefix, see `mcore-train preprocess`)"
            )
        splits = embedded_corpus_dataset(
            split=data.split, packing=data.packing, eod_mask_loss=data.eod_mask_loss, **common
        )
    else:
        try:
            blend = data.path if isinstance(data.path, str) else [str(item) for item in data.path]
            splits = build_gpt_datasets(
                blend,
                split=data.split,
                packing=data.packing,
                eod_id=tokenizer.eod_id,
                eod_mask_loss=data.eod_mask_loss,
                **common,
            )
        except (ValueError, TypeError) as exc:
            if isinstance(exc, UserError):  # an EmptySplitError, a DataError naming its file
                raise
            raise UserError(f"data.path={data.path!r}: {exc}") from None
    return splits


def microbatch_stream(
    dataset: torch.utils.data.Dataset,
    config: Config,
    *,
    consumed_samples: int,
    dp_rank: int,
    dp_size: int,
) -> Iterator[dict[str, Any]]:
    """This rank's micro-batches, starting after ``consumed_samples`` (the data state of a checkpoint)."""
    try:
        loader = build_data_loader(
            dataset,
            micro_batch_size=config.train.micro_batch_size,
            consumed_samples=consumed_samples,
            dp_rank=dp_rank,
            dp_size=dp_size,
            num_workers=config.data.num_workers,
            pin_memory=torch.cuda.is_available(),
        )
    except ValueError as exc:  # e.g. a resumed run whose batch sizes no longer divide the consumed samples
        raise UserError(f"cannot resume the data stream after {consumed_samples} samples: {exc}") from None
    return iter(loader)
