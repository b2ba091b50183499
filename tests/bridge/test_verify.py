"""``verify`` passes on a faithful conversion, fails (exit 1) on a wrong one and names the first divergent layer."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from mcore.bridge.cli import main
from mcore.bridge.convert import convert
from mcore.bridge.errors import BridgeError
from mcore.bridge.mappings import FAMILIES
from mcore.bridge.verify import verify
from tests.bridge.factory import save_tiny_hf


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("verify")
    hf = save_tiny_hf(root / "hf", "qwen2", seed=8, tie_word_embeddings=True, num_hidden_layers=3)
    convert(hf, root / "mcore", progress=False)
    # the same model with one weight of layer 1 nudged: layers 0 agree, layer 1 on diverge
    nudged = shutil.copytree(hf, root / "hf-nudged")
    state = load_file(nudged / "model.safetensors")
    state["model.layers.1.mlp.down_proj.weight"] += 1e-2 * torch.randn_like(
        state["model.layers.1.mlp.down_proj.weight"]
    )
    save_file(state, nudged / "model.safetensors", metadata={"format": "pt"})
    convert(nudged, root / "mcore-nudged", progress=False)
    return root


def test_faithful_conversion_passes(models, capsys):
    report = verify(models / "hf", models / "mcore", tokens=40)
    assert report.passed and report.first_divergent_layer is None
    assert report.max_abs_logit_diff <= 1e-4 and abs(report.mean_kl) <= 1e-8 and report.top1_agreement == 1.0
    assert len(report.layer_max_abs_diff) == 3
    assert main(["verify", str(models / "hf"), str(models / "mcore"), "--tokens", "16"]) == 0
    out = capsys.readouterr().out
    assert out.strip().endswith("PASS") and "max |logit diff|" in out and "top-1 agreement" in out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_verifies(tmp_path, family):
    hf = save_tiny_hf(tmp_path / "hf", family, seed=18, dtype=torch.bfloat16)
    convert(hf, tmp_path / "mcore", progress=False)
    report = verify(hf, tmp_path / "mcore", tokens=48)
    assert report.passed, report.format()


def test_wrong_weights_fail_and_name_the_first_divergent_layer(models, capsys):
    report = verify(models / "hf", models / "mcore-nudged", tokens=40)
    assert not report.passed and report.first_divergent_layer == 1
    assert report.layer_max_abs_diff[0] <= 1e-5 < report.layer_max_abs_diff[1]
    assert main(["verify", str(models / "hf"), str(models / "mcore-nudged"), "--json"]) == 1
    printed = json.loads(capsys.readouterr().out)
    assert printed["passed"] is False and printed["first_divergent_layer"] == 1
    loose = ["--rtol", "10", "--max-kl", "10"]  # tolerances are the user's to choose
    assert main(["verify", str(models / "hf"), str(models / "mcore-nudged"), *loose]) == 0


def test_different_models_and_wrong_argument_order_are_bad_input(models, tmp_path, capsys):
    other = save_tiny_hf(tmp_path / "other", "qwen2", seed=8, tie_word_embeddings=True, num_hidden_layers=2)
    with pytest.raises(BridgeError, match="describe different models .*num_hidden_layers"):
        verify(other, models / "mcore")
    assert main(["verify", str(models / "mcore"), str(models / "hf")]) == 2
    assert "takes a Hugging Face model then an mcore checkpoint" in capsys.readouterr().err


def test_missing_transformers_says_how_to_install_it(models, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(BridgeError, match="pip install transformers"):
        verify(models / "hf", models / "mcore")
