"""Training data: Megatron ``.bin/.idx`` datasets, GPT sample building, blends, mock data and resumable loading.

Typical use::

    splits = build_gpt_datasets("0.7 data/web 0.3 data/code", seq_length=2048,
                                num_samples=(train_samples, valid_samples, 0), seed=1234, split="98,2,0")
    loader = build_data_loader(splits.train, micro_batch_size=4, consumed_samples=consumed,
                               dp_rank=groups.dp_rank, dp_size=groups.dp_size)
    for batch in loader:   # tokens, labels (-100 = ignored), loss_mask, position_ids [, cu_seqlens, max_seqlen]
        ...

The data state to checkpoint is ``consumed_samples`` (plus the arguments above); see ``gpt_dataset.py`` for why
the sample order after a resume is the one the uninterrupted run would have seen.
"""

from mcore.train.data.blended import BlendedDataset, blending_indices, samples_per_dataset
from mcore.train.data.builder import (
    DatasetSplits,
    build_gpt_datasets,
    build_gpt_datasets_from_corpora,
    build_mock_datasets,
    parse_blend,
)
from mcore.train.data.embedded import (
    embedded_corpus_dataset,
    embedded_corpus_documents,
    embedded_corpus_text,
    embedded_indexed_dataset,
)
from mcore.train.data.errors import DataError, EmptySplitError
from mcore.train.data.gpt_dataset import GPTSampleDataset
from mcore.train.data.indexed import (
    IndexedDataset,
    IndexedDatasetWriter,
    TokenDocuments,
    bin_path,
    idx_path,
    token_dtype_for_vocab,
)
from mcore.train.data.memory import InMemoryIndexedDataset
from mcore.train.data.mock import MockGPTDataset
from mcore.train.data.sampler import MicroBatchSampler, build_data_loader
from mcore.train.data.samples import IGNORE_INDEX, build_sample, collate_gpt_batch
from mcore.train.data.splits import parse_split, split_document_ranges

__all__ = [
    "IGNORE_INDEX",
    "BlendedDataset",
    "DataError",
    "EmptySplitError",
    "DatasetSplits",
    "GPTSampleDataset",
    "InMemoryIndexedDataset",
    "IndexedDataset",
    "IndexedDatasetWriter",
    "MicroBatchSampler",
    "MockGPTDataset",
    "TokenDocuments",
    "bin_path",
    "blending_indices",
    "build_data_loader",
    "build_gpt_datasets",
    "build_gpt_datasets_from_corpora",
    "build_mock_datasets",
    "build_sample",
    "collate_gpt_batch",
    "embedded_corpus_dataset",
    "embedded_corpus_documents",
    "embedded_corpus_text",
    "embedded_indexed_dataset",
    "idx_path",
    "parse_blend",
    "parse_split",
    "samples_per_dataset",
    "split_document_ranges",
    "token_dtype_for_vocab",
]
