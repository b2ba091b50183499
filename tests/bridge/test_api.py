"""The Python API: ``load_hf_into`` a single-process GPTModel of each family (transformers logits within 1e-4),
``export_hf`` of a model in memory, and the errors for a model that does not match or is only a stage."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM

from mcore.bridge.api import export_hf, load_hf_into
from mcore.bridge.config_translation import hf_to_mcore
from mcore.bridge.errors import BridgeError
from mcore.bridge.hf import read_config
from mcore.bridge.mappings import FAMILIES
from mcore.models.gpt import GPTModel
from mcore.parallel.param_attrs import persistent_buffers
from tests.bridge.factory import read_state, save_tiny_hf

IDS = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(3))


def _model_for(hf) -> GPTModel:
    config = read_config(hf)
    return GPTModel(hf_to_mcore(config, FAMILIES[config["model_type"]])).eval()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_load_hf_into_gives_transformers_logits(tmp_path, family):
    hf = save_tiny_hf(tmp_path / "hf", family, seed=12, dtype=torch.bfloat16)
    model = _model_for(hf)
    loaded = load_hf_into(model, hf)
    assert loaded == [n for n, _ in [*model.named_parameters(), *persistent_buffers(model)]]
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32, attn_implementation="eager")(IDS).logits
        got = model(IDS)[..., :300]
    assert (got - want).abs().max().item() <= 1e-4


def test_export_hf_of_a_model_round_trips_through_transformers(tmp_path):
    hf = save_tiny_hf(tmp_path / "hf", "qwen3", seed=13, tie_word_embeddings=True)
    model = _model_for(hf)
    load_hf_into(model, hf)
    result = export_hf(model, tmp_path / "out", dtype="keep", hf_assets=hf)
    assert result.family == "qwen3" and result.tensors == len(read_state(hf))
    source, out = read_state(hf), read_state(tmp_path / "out")
    assert all(torch.equal(out[k], source[k]) for k in source)
    assert (tmp_path / "out" / "config.json").read_bytes() == (hf / "config.json").read_bytes()
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (hf / "tokenizer.json").read_bytes()

    with pytest.raises(BridgeError, match="already exists"):
        export_hf(model, tmp_path / "out")
    export_hf(model, tmp_path / "out", dtype="bf16", overwrite=True)
    assert all(t.dtype == torch.bfloat16 for t in read_state(tmp_path / "out").values())


def test_a_model_of_another_shape_is_refused(tmp_path):
    hf = save_tiny_hf(tmp_path / "hf", "llama", seed=14)
    config = hf_to_mcore(read_config(hf), FAMILIES["llama"])
    model = GPTModel(dataclasses.replace(config, intermediate_size=128))
    with pytest.raises(BridgeError, match="intermediate_size: model 128 vs config.json 96"):
        load_hf_into(model, hf)


def test_export_of_a_pipeline_stage_points_to_checkpoints(tmp_path):
    hf = save_tiny_hf(tmp_path / "hf", "llama", seed=15)
    config = hf_to_mcore(read_config(hf), FAMILIES["llama"])
    stage = GPTModel(config, layer_range=(0, 1), post_process=False)
    load_hf_into(stage, hf)  # a stage loads its own subset
    with pytest.raises(BridgeError, match="whole model in one process"):
        export_hf(stage, tmp_path / "out")
    assert not (tmp_path / "out").exists()
