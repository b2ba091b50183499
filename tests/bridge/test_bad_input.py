"""Bad input fails with one clear line (exit status 2), before anything is written: DST stays untouched."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mcore.bridge.cli import main
from tests.bridge.factory import save_tiny_hf
from tests.helpers.families import families


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return save_tiny_hf(tmp_path_factory.mktemp("src") / "hf", "llama", seed=11, max_shard_size="80KB")


@pytest.fixture()
def hf(pristine, tmp_path) -> Path:
    return Path(shutil.copytree(pristine, tmp_path / "hf"))


def _edit_tensors(hf: Path, edit) -> None:
    """Apply ``edit(state_of_one_shard, shard_name)`` to every shard and keep the index consistent."""
    index_file = hf / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    for shard in sorted(hf.glob("*.safetensors")):
        state = load_file(shard)
        edit(state, shard.name)
        save_file(state, shard, metadata={"format": "pt"})
        index["weight_map"] = {n: f for n, f in index["weight_map"].items() if f != shard.name}
        index["weight_map"].update({n: shard.name for n in state})
    index_file.write_text(json.dumps(index))


def _edit_config(hf: Path, **changes) -> None:
    config = json.loads((hf / "config.json").read_text())
    config.update(changes)
    (hf / "config.json").write_text(json.dumps(config))


def _fails(capsys, src: Path | str, dst: Path, *fragments: str, extra: tuple[str, ...] = ()) -> str:
    rc = main(["convert", str(src), str(dst), "--no-progress", *extra])
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mcore-bridge: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    assert not dst.exists() or dst.is_dir() and (dst / "marker").exists()
    leftovers = [p.name for p in dst.parent.iterdir() if ".tmp-" in p.name]
    assert leftovers == [], leftovers
    return lines[0]


def test_unsupported_architecture_lists_the_supported_ones(capsys, hf, tmp_path):
    _edit_config(hf, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    _fails(
        capsys,
        hf,
        tmp_path / "out",
        "unsupported architecture ['GPT2LMHeadModel']",
        "llama (LlamaForCausalLM)",
        "qwen2 (Qwen2ForCausalLM)",
        "qwen3 (Qwen3ForCausalLM)",
        "mistral (MistralForCausalLM)",
    )


def test_missing_tensor_is_named(capsys, hf, tmp_path):
    _edit_tensors(hf, lambda state, _: state.pop("model.layers.1.mlp.up_proj.weight", None))
    _fails(capsys, hf, tmp_path / "out", "missing tensor(s)", "model.layers.1.mlp.up_proj.weight")


def test_extra_tensor_is_named(capsys, hf, tmp_path):
    def add(state, shard):
        if shard.startswith("model-00001-of-"):
            state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.rand(8)

    _edit_tensors(hf, add)
    _fails(
        capsys,
        hf,
        tmp_path / "out",
        "no llama mapping consumes",
        "model.layers.0.self_attn.rotary_emb.inv_freq",
        "recomputed from config.json",
    )


def test_stored_lm_head_of_a_tied_model_is_an_extra_tensor_with_a_hint(capsys, hf, tmp_path):
    _edit_config(hf, tie_word_embeddings=True)
    _fails(capsys, hf, tmp_path / "out", "lm_head.weight", "tie_word_embeddings=true")


def test_shape_mismatch_against_config_names_tensor_and_shapes(capsys, hf, tmp_path):
    _edit_config(hf, intermediate_size=80)
    _fails(capsys, hf, tmp_path / "out", "model.layers.0.mlp.gate_proj.weight", "[96, 64]", "[80, 64]")


def test_truncated_safetensors_file(capsys, hf, tmp_path):
    shard = sorted(hf.glob("*.safetensors"))[-1]
    data = shard.read_bytes()
    shard.write_bytes(data[:-100])
    _fails(capsys, hf, tmp_path / "out", shard.name, "truncated safetensors file")


def test_index_naming_a_missing_shard(capsys, hf, tmp_path):
    sorted(hf.glob("*.safetensors"))[0].unlink()
    _fails(capsys, hf, tmp_path / "out", "missing from", "the download is incomplete")


def test_pickle_only_weights_are_refused_with_the_fix(capsys, hf, tmp_path):
    for f in hf.glob("*.safetensors*"):
        f.unlink()
    (hf / "pytorch_model.bin").write_bytes(b"not read")
    _fails(capsys, hf, tmp_path / "out", "only PyTorch pickle weights", "safe_serialization=True")


def test_existing_destination_is_refused_and_untouched(capsys, hf, tmp_path):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "marker").write_text("mine")
    _fails(capsys, hf, dst, "already exists; pass --overwrite")
    assert (dst / "marker").read_text() == "mine"


def test_bad_input_with_overwrite_keeps_the_old_destination(capsys, hf, tmp_path):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "marker").write_text("mine")
    _edit_tensors(hf, lambda state, _: state.pop("model.norm.weight", None))
    _fails(capsys, hf, dst, "model.norm.weight", extra=("--overwrite",))
    assert (dst / "marker").read_text() == "mine"


def test_source_that_does_not_exist(capsys, tmp_path):
    _fails(capsys, tmp_path / "nowhere", tmp_path / "out", "no such file or directory")


def test_mcore_checkpoint_of_an_unmapped_family(capsys, hf, tmp_path):
    from mcore.models.config import TransformerConfig
    from mcore.train.checkpoint import ModelCheckpointWriter, expected_model_tensors

    config = TransformerConfig(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=2,
        vocab_size=50,
        model_type="gpt-neox",
    )
    with ModelCheckpointWriter(tmp_path / "ckpt", config) as writer:
        for name, meta in expected_model_tensors(config).items():
            writer.add(name, torch.randn(meta.shape))
    _fails(capsys, tmp_path / "ckpt", tmp_path / "out", "model_type 'gpt-neox' has no Hugging Face mapping", "llama")


def test_unknown_dtype_choice_is_an_argument_error(capsys, hf, tmp_path):
    with pytest.raises(SystemExit) as exc:
        main(["convert", str(hf), str(tmp_path / "out"), "--dtype", "fp8"])
    assert exc.value.code == 2
    assert "invalid choice: 'fp8'" in capsys.readouterr().err


def test_mixed_dtypes_need_an_explicit_dtype(capsys, hf, tmp_path):
    def widen(state, _):
        if "model.norm.weight" in state:
            state["model.norm.weight"] = state["model.norm.weight"].double()

    _edit_tensors(hf, widen)
    _fails(capsys, hf, tmp_path / "out", "mixed dtypes ['float32', 'float64']", "pass --dtype")
    assert main(["convert", str(hf), str(tmp_path / "out"), "--no-progress", "--dtype", "fp32"]) == 0


@pytest.mark.parametrize("family", families())
def test_every_family_names_a_missing_and_an_extra_tensor(capsys, tmp_path, family):
    hf = save_tiny_hf(tmp_path / "hf", family, seed=5, tokenizer=False)
    capsys.readouterr()  # transformers' save progress is not the converter's output
    (shard,) = hf.glob("*.safetensors")
    state = load_file(shard)
    victim = sorted(n for n in state if ".layers." in n)[-1]
    save_file({n: t for n, t in state.items() if n != victim}, shard, metadata={"format": "pt"})
    _fails(capsys, hf, tmp_path / "out", "missing tensor(s)", victim)
    extra = victim.rsplit(".", 2)[0] + ".unexpected.weight"
    save_file({**state, extra: torch.rand(4)}, shard, metadata={"format": "pt"})
    _fails(capsys, hf, tmp_path / "out2", f"no {family} mapping consumes", extra)
