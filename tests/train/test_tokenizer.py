"""ByteTokenizer and HFTokenizer (tokenizers built offline here; the Hub path through a prepared local cache)."""

from __future__ import annotations

import json
import pickle
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from mcore.train.tokenizer import ByteTokenizer, HFTokenizer, TokenizerError, load_tokenizer

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "a small model learns the shape of the data",
    "tokenizers split text into pieces and ids",
    "über naïve café, déjà vu — 東京 and emoji 🙂",
]


def _train_bpe(special_tokens: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=special_tokens, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(SENTENCES * 5, trainer)
    return tok


@pytest.fixture(scope="module")
def bpe_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    _train_bpe(["<|endoftext|>"]).save(str(path))
    return str(path)


def _random_text(rng: random.Random, n: int) -> str:
    alphabet = "abcdefghij XYZ\n\t.,!éüß東京🙂\u0000"
    return "".join(rng.choice(alphabet) for _ in range(n))


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    rng = random.Random(0)
    for _ in range(50):
        text = _random_text(rng, rng.randint(0, 200))
        ids = tok.encode(text)
        assert ids == list(text.encode("utf-8"))
        assert tok.decode(ids) == text
    assert tok.vocab_size == 259 and tok.eod_id == 256
    assert isinstance(tok.encode("x")[0], int)


def test_byte_tokenizer_special_tokens_and_bad_ids():
    tok = ByteTokenizer()
    ids = tok.encode("ab") + [tok.eod_id] + tok.encode("é")[:1] + [tok.bos_id] + tok.encode("c")
    assert tok.decode(ids) == "ab\ufffdc"  # a character cut in half decodes to U+FFFD
    assert tok.decode(ids, skip_special_tokens=False) == "ab<|eod|>\ufffd<|bos|>c"
    with pytest.raises(ValueError, match=r"ids are in \[0, 259\), got \[300\]"):
        tok.decode([1, 300])
    with pytest.raises(TypeError, match="takes a str"):
        tok.encode(b"bytes")


def test_hf_tokenizer_matches_the_tokenizers_library(bpe_file, tmp_path):
    reference = Tokenizer.from_file(bpe_file)
    tok = HFTokenizer(bpe_file)
    assert tok.vocab_size == reference.get_vocab_size(with_added_tokens=True)
    assert tok.eod_id == reference.token_to_id("<|endoftext|>")
    for text in SENTENCES + ["unseen words zebra quartz"]:
        assert tok.encode(text) == reference.encode(text).ids
        assert tok.decode(tok.encode(text)) == text
    # A directory holding tokenizer.json works too.
    directory = tmp_path / "tok_dir"
    directory.mkdir()
    reference.save(str(directory / "tokenizer.json"))
    assert HFTokenizer(directory).encode(SENTENCES[0]) == reference.encode(SENTENCES[0]).ids


def test_hf_tokenizer_pickles_by_path(bpe_file):
    tok = HFTokenizer(bpe_file)
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.encode(SENTENCES[1]) == tok.encode(SENTENCES[1]) and clone.eod_id == tok.eod_id


def test_eod_token_resolution(tmp_path):
    directory = tmp_path / "no_eod"
    directory.mkdir()
    _train_bpe(["<s>", "<stop>"]).save(str(directory / "tokenizer.json"))
    tok = HFTokenizer(directory)
    with pytest.raises(TokenizerError, match="no recognizable end-of-document token.*--eod-token"):
        _ = tok.eod_id
    assert HFTokenizer(directory, eod_token="<stop>").eod_id == tok._tokenizer.token_to_id("<stop>")
    with pytest.raises(TokenizerError, match="eod_token '<nope>' is not in the vocabulary"):
        HFTokenizer(directory, eod_token="<nope>")
    # tokenizer_config.json's eos_token is used when present.
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<stop>"}}))
    assert HFTokenizer(directory).eod_id == tok._tokenizer.token_to_id("<stop>")


def test_hub_id_served_offline_from_the_cache(bpe_file, tmp_path):
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "cache" / "models--acme--tiny-bpe"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    (snapshot / "tokenizer.json").write_bytes(Path(bpe_file).read_bytes())
    tok = HFTokenizer("acme/tiny-bpe", cache_dir=str(tmp_path / "cache"), local_files_only=True)
    assert tok.encode(SENTENCES[2]) == Tokenizer.from_file(bpe_file).encode(SENTENCES[2]).ids
    with pytest.raises(TokenizerError, match="neither a local path nor in the Hugging Face cache"):
        HFTokenizer("acme/not-cached", cache_dir=str(tmp_path / "cache"), local_files_only=True)


def test_bad_tokenizer_paths(tmp_path):
    with pytest.raises(TokenizerError, match="not found"):
        HFTokenizer(str(tmp_path / "missing" / "tokenizer.json"))
    with pytest.raises(TokenizerError, match="holds no tokenizer.json"):
        HFTokenizer(tmp_path)
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(TokenizerError, match="cannot load tokenizer file"):
        HFTokenizer(broken)


def test_load_tokenizer_dispatch(bpe_file):
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)
    assert isinstance(load_tokenizer(bpe_file), HFTokenizer)
    with pytest.raises(TypeError, match="byte tokenizer takes no options"):
        load_tokenizer("byte", eod_token="x")
