"""The typed config: YAML plus overrides, presets, and one clear error per bad input."""

from __future__ import annotations

import pytest
import yaml

from mcore.models.families import get_config
from mcore.train.config import DEMO_MODEL, Config, build_config, config_to_dict, dump_config, load_config
from mcore.train.errors import UserError


def test_defaults_are_the_demo_and_round_trip_through_yaml():
    config = load_config()
    assert config.model.hidden_size == DEMO_MODEL["hidden_size"]
    assert config.model.vocab_size == DEMO_MODEL["vocab_size"]
    again = build_config(yaml.safe_load(dump_config(config)))
    assert config_to_dict(again) == config_to_dict(config)


def test_yaml_then_overrides_in_order(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "model:\n  preset: llama-tiny\n  num_hidden_layers: 4\n"
        "train:\n  steps: 40\n  global_batch_size: 8\n  micro_batch_size: 2\n"
        "lr:\n  max_lr: 1.0e-3\n  min_lr: 0.0\n  warmup_steps: 4\n"
    )
    config = load_config(path, ["train.steps=60", "lr.max_lr=2e-3", "data.path=0123", "parallel.pp=2"])
    assert config.model.num_hidden_layers == 4
    assert config.model.hidden_size == get_config("llama-tiny").hidden_size
    assert config.train.steps == 60 and config.train.micro_batch_size == 2
    assert config.lr.max_lr == 2e-3  # "2e-3" is a string to YAML; the float field converts it
    assert config.data.path == "0123"  # a str field keeps the override's text as written
    assert config.parallel.pp == 2


def test_model_named_by_preset_on_the_command_line():
    config = load_config(None, ["model=llama3-8b", "model.num_hidden_layers=2", "data.seq_length=1024"])
    expected = get_config("llama3-8b", num_hidden_layers=2)
    assert config.model == expected


def test_num_microbatches_follows_dp():
    config = load_config(None, ["train.global_batch_size=32", "train.micro_batch_size=4"])
    assert config.num_microbatches(1) == 8
    assert config.num_microbatches(2) == 4
    with pytest.raises(UserError, match="multiple of train.micro_batch_size x dp"):
        config.num_microbatches(3)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["train.stpes=3"], "unknown config key 'train.stpes'; did you mean 'train.steps'?"),
        (["optim.wieght_decay=0.1"], "did you mean 'optim.weight_decay'"),
        (["model.hiden_size=8"], "did you mean 'model.hidden_size'"),
        (["trian.steps=3"], "did you mean 'train'"),
        (["train.steps=abc"], "'train.steps' expects an integer, got 'abc'"),
        (["train.steps=2.5"], "'train.steps' expects an integer, got 2.5"),
        (["train.precision=fp6"], "'train.precision' must be one of 'auto', 'fp32', 'bf16', 'fp16', 'fp8', 'fp4'"),
        (["checkpoint.async_save=maybe"], "'checkpoint.async_save' expects true or false"),
        (["model=llama3-8"], "unknown model preset 'llama3-8'; did you mean 'llama3-8b'?"),
        (["model=llama3-8b", "parallel.tp=3"], "tensor parallel size 3 must divide num_key_value_heads"),
        (["parallel.pp=3"], "num_hidden_layers (4) must be divisible by parallel.pp x parallel.vpp"),
        (["lr.min_lr=1"], "must not exceed lr.max_lr"),
        (["lr.warmup_steps=500"], "lr.warmup_steps (500) exceeds the decay end (300)"),
        (["train.global_batch_size=10", "train.micro_batch_size=4"], "must be a multiple of train.micro_batch_size"),
        (["data.seq_length=4096"], "exceeds model.max_position_embeddings"),
        (["train=3"], "config section 'train' expects a mapping"),
        (["train.steps"], "expected an override of the form section.key=value"),
        (["parallel.sequence_parallel=true"], "sequence_parallel needs tp > 1"),
        (["parallel.overlap_param_gather=true"], "needs parallel.distributed_optimizer=true"),
        (["parallel.pp=2", "parallel.pipeline_layout=[3,2]"], "holds 5 layers but model.num_hidden_layers is 4"),
        (["parallel.pp=2", "parallel.pipeline_layout=[a, b]"], "expects str or list[int], got ['a', 'b']"),
    ],
)
def test_bad_input_raises_one_clear_user_error(overrides, message):
    with pytest.raises(UserError) as info:
        load_config(None, overrides)
    assert message in str(info.value)


def test_missing_and_malformed_config_files(tmp_path):
    with pytest.raises(UserError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed\n")
    with pytest.raises(UserError, match="not valid YAML"):
        load_config(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(UserError, match="must hold a mapping"):
        load_config(listy)


def test_model_section_without_preset_must_be_complete(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("model:\n  hidden_size: 64\n")
    with pytest.raises(UserError, match="missing required key"):
        load_config(path)


def test_config_is_a_plain_dataclass_with_defaults():
    assert isinstance(Config(), Config)
    assert Config().train.precision == "auto"


def test_pipeline_layout_even_balanced_or_explicit():
    from mcore.train.plan import make_plan
    from mcore.train.trainer import pipeline_layout

    shape = [
        "model=llama3-8b",
        "model.num_hidden_layers=4",
        "data.seq_length=4096",
        "train.micro_batch_size=1",
        "train.global_batch_size=8",
    ]
    even = load_config(None, [*shape, "parallel.pp=2"])
    assert pipeline_layout(even, 2) is None
    # the 128k-vocabulary output layer costs ~2.3 layers of this shape: three layers go to the first stage
    balanced = load_config(None, [*shape, "parallel.pp=2", "parallel.pipeline_layout=balanced"])
    assert pipeline_layout(balanced, 2) == [3, 1]
    vpp = load_config(None, [*shape, "parallel.pp=2", "parallel.vpp=2", "parallel.pipeline_layout=balanced"])
    assert pipeline_layout(vpp, 2) == [2, 1, 1, 0]
    explicit = load_config(None, [*shape, "parallel.pp=2", "parallel.pipeline_layout=[1, 3]"])
    assert pipeline_layout(explicit, 2) == [1, 3]
    # a layout also lifts the even split's divisibility rule: 4 layers over 3 stages
    three = load_config(None, [*shape, "parallel.pp=3", "parallel.pipeline_layout=balanced"])
    assert pipeline_layout(three, 3) == [2, 2, 0]
    # the memory plan counts each rank's layers from the same layout
    plans = {name: make_plan(cfg, 2, 141.0) for name, cfg in (("even", even), ("balanced", balanced))}
    assert plans["balanced"].stages[0].parameters > plans["even"].stages[0].parameters
    assert plans["balanced"].stages[1].parameters < plans["even"].stages[1].parameters
    assert [s.layers for s in plans["balanced"].stages] == [3, 1] and [s.layers for s in plans["even"].stages] == [2, 2]
    with pytest.raises(UserError, match="pipeline_layout .* has 3 entries"):
        load_config(None, [*shape, "parallel.pp=2", "parallel.pipeline_layout=[1,1,2]"])


def test_a_key_taking_a_string_or_a_list_reads_brackets_on_the_command_line_as_a_list():
    blend = load_config(None, ["data.path=[0.3, corpus_a, 0.7, corpus_b]"]).data.path
    assert blend == [0.3, "corpus_a", 0.7, "corpus_b"]
    assert load_config(None, ["data.path=corpus_a"]).data.path == "corpus_a"
    assert load_config(None, ["parallel.pp=2", "parallel.pipeline_layout=[3, 1]"]).parallel.pipeline_layout == [3, 1]
