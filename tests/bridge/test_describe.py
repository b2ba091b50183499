"""``inspect`` and ``list``: family, config, tensors, sizes and layout, for HF directories and mcore checkpoints."""

from __future__ import annotations

import json
import shutil

import pytest

from mcore.bridge.cli import main
from mcore.bridge.convert import convert
from mcore.bridge.describe import describe
from mcore.bridge.mappings import FAMILIES
from tests.bridge.factory import read_state, save_tiny_hf


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("describe")
    hf = save_tiny_hf(root / "hf", "llama", seed=9, tie_word_embeddings=True, max_shard_size="100KB")
    convert(hf, root / "mcore", progress=False)
    return hf, root / "mcore"


def test_inspect_hf_directory(dirs, capsys):
    hf, _ = dirs
    d = describe(hf)
    state = read_state(hf)
    assert d.kind == "hf" and d.family == "llama"
    assert sorted(t.name for t in d.tensors) == sorted(state)
    assert d.total_bytes == sum(t.numel() * t.element_size() for t in state.values())
    assert {t.name: t.shape for t in d.tensors}["model.embed_tokens.weight"] == [300, 64]
    assert "bos_token_id" in d.details["carried"] and "tokenizer.json" in d.details["side files"]
    assert main(["inspect", str(hf)]) == 0
    out = capsys.readouterr().out
    assert "family:     llama" in out and "model.embed_tokens.weight" in out and "file(s)" in out


def test_inspect_mcore_checkpoint_as_json(dirs, capsys):
    _, mcore = dirs
    assert main(["inspect", str(mcore), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["kind"] == "mcore" and d["family"] == "llama" and d["layout"] == "mcore tp=1 pp=1 vpp=1 dp=1"
    tensors = {t["name"]: t for t in d["tensors"]}
    assert tensors["embedding.weight"]["shape"] == [384, 64] and "output.weight" not in tensors
    assert d["details"]["vocab"] == "300 rows, padded to 384" and d["details"]["contents"] == "model only"
    assert d["config"]["tie_word_embeddings"] is True
    assert d["total_bytes"] == sum(t["nbytes"] for t in d["tensors"])


def test_inspect_reports_an_unsupported_architecture_instead_of_failing(dirs, tmp_path):
    hf, _ = dirs
    other = shutil.copytree(hf, tmp_path / "other")
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "architectures": ["FalconForCausalLM"]}))
    assert describe(other).family == "unsupported: ['FalconForCausalLM']"


def test_list_names_the_supported_families(capsys):
    assert main(["list"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    families = ["llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen3_moe", "qwen2_moe", "olmoe"]
    names = [line.split()[0] for line in lines]
    assert names[: len(families)] == families and names == list(FAMILIES)  # built-ins first, in registry order
    assert "Qwen3ForCausalLM" in lines[2]


def test_convert_command_reports_what_it_wrote(dirs, tmp_path, capsys):
    hf, _ = dirs
    assert main(["convert", str(hf), str(tmp_path / "out"), "--no-progress", "--to", "mcore"]) == 0
    assert capsys.readouterr().out.startswith("hf->mcore: llama, 14 tensors")


def test_progress_bar_counts_tensors_and_bytes(dirs, tmp_path, capsys):
    hf, _ = dirs
    convert(hf, tmp_path / "out", progress=True)
    err = capsys.readouterr().err
    assert "hf -> mcore: 100%" in err and "337k/337k" in err and "14/14 tensors" in err
