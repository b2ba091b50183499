import torch

from mcore.train.config import load_config
from mcore.train.datasets import build_run_data


def test_mock_tokens_span_the_model_vocabulary_not_the_tokenizers():
    # Benchmarks run mock data through real vocabularies (e.g. 128256): the byte tokenizer's 259 ids must not cap it.
    config = load_config(
        None, ["data.mock=true", "model.vocab_size=5000", "data.seq_length=64", "train.steps=2", "lr.warmup_steps=1"]
    )
    run = build_run_data(config)
    tokens = torch.cat([torch.as_tensor(run.train[i]["tokens"]) for i in range(8)])
    assert int(tokens.max()) >= 259
    assert int(tokens.max()) < 5000 and int(tokens.min()) >= 0
