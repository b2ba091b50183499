"""Hub ids: fetched with huggingface-hub's snapshot_download (only config, weights and tokenizer files), and
converted offline from a populated local cache; a missing id fails in one line."""

from __future__ import annotations

import fnmatch

import huggingface_hub
import huggingface_hub.constants
import pytest
import torch

from mcore.bridge import hub
from mcore.bridge.convert import convert
from mcore.bridge.errors import BridgeError
from tests.bridge.factory import read_state, save_tiny_hf


@pytest.fixture()
def offline_cache(tmp_path, monkeypatch):
    """A hub cache holding ``acme/tiny-qwen3`` at one revision, exactly as huggingface-hub lays it out."""
    cache = tmp_path / "hub-cache"
    repo = cache / "models--acme--tiny-qwen3"
    commit = "0123456789abcdef0123456789abcdef01234567"
    save_tiny_hf(repo / "snapshots" / commit, "qwen3", seed=5)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return repo / "snapshots" / commit


def test_hub_id_converts_offline_from_the_cache(tmp_path, offline_cache):
    result = convert("acme/tiny-qwen3", tmp_path / "mcore", progress=False)
    assert result.source == offline_cache and result.family == "qwen3"
    convert(tmp_path / "mcore", tmp_path / "back", progress=False)
    source, back = read_state(offline_cache), read_state(tmp_path / "back")
    assert sorted(source) == sorted(back) and all(torch.equal(source[k], back[k]) for k in source)


def test_uncached_hub_id_fails_in_one_line(tmp_path, offline_cache):
    with pytest.raises(BridgeError) as exc:
        convert("acme/not-there", tmp_path / "out", progress=False)
    message = str(exc.value)
    assert "\n" not in message and "acme/not-there" in message and "local cache" in message
    assert not (tmp_path / "out").exists()


def test_fetch_asks_for_weights_config_and_tokenizer_only(tmp_path, monkeypatch):
    calls = []
    snapshot = save_tiny_hf(tmp_path / "snap", "llama", seed=1)

    def fake_snapshot_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    assert hub.fetch("meta-llama/Llama-3.2-1B@refs/pr/3") == snapshot
    repo_id, kwargs = calls[0]
    assert repo_id == "meta-llama/Llama-3.2-1B" and kwargs["revision"] == "refs/pr/3"
    patterns = kwargs["allow_patterns"]
    assert {"model*.safetensors", "*.json", "tokenizer.model*", "*.jinja"} <= set(patterns)
    assert not any(p.endswith((".bin", ".pth", ".pt")) for p in patterns)
    assert not any(fnmatch.fnmatch("consolidated.safetensors", p) for p in patterns)


def test_hub_ids_are_told_apart_from_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "local-model").mkdir()
    assert hub.looks_like_hub_id("Qwen/Qwen3-0.6B") and hub.looks_like_hub_id("gpt2")
    assert hub.looks_like_hub_id("owner/name@v1.0")
    assert not hub.looks_like_hub_id("local-model")  # exists: a path
    assert not hub.looks_like_hub_id("./model") and not hub.looks_like_hub_id("/abs/model")
    assert not hub.looks_like_hub_id("a/b/c")
