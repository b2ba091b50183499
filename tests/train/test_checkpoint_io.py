"""Checkpoint files: the streaming safetensors writer, the reader, atomic directories, corrupt input."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mcore.models.families import get_config
from mcore.models.gpt import GPTModel
from mcore.train.checkpoint import CheckpointReader, ModelCheckpointWriter, resolve_checkpoint_dir
from mcore.train.checkpoint.directory import CheckpointDirectory
from mcore.train.checkpoint.resharding import Target
from mcore.train.checkpoint.safetensors_stream import SafetensorsStreamWriter
from mcore.train.errors import CheckpointError


def test_stream_writer_any_order_reads_back_with_safetensors(tmp_path):
    tensors = {
        "b": torch.randn(3, 5, dtype=torch.bfloat16),
        "a": torch.randn(7, dtype=torch.float32),
        "c": torch.randint(-5, 5, (2, 2, 2), dtype=torch.int64),
        "d": torch.randn(1, 3, dtype=torch.float16),
    }
    path = tmp_path / "x.safetensors"
    writer = SafetensorsStreamWriter(path, {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()}, {"k": "v"})
    for name in ["c", "a", "d", "b"]:
        writer.write(name, tensors[name])
    writer.close()
    with safe_open(str(path), framework="pt") as fh:
        assert fh.metadata() == {"k": "v"}
        assert sorted(fh.keys()) == sorted(tensors)
        for name, tensor in tensors.items():
            assert torch.equal(fh.get_tensor(name), tensor)


def test_stream_writer_rejects_wrong_input(tmp_path):
    writer = SafetensorsStreamWriter(tmp_path / "y.safetensors", {"w": (torch.float32, (2, 3))})
    with pytest.raises(KeyError, match="not declared"):
        writer.write("v", torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"declared torch.float32 \[2, 3\], got torch.float32 \[3, 2\]"):
        writer.write("w", torch.zeros(3, 2))
    writer.write("w", torch.zeros(2, 3))
    with pytest.raises(ValueError, match="already written"):
        writer.write("w", torch.zeros(2, 3))
    writer.close()
    incomplete = SafetensorsStreamWriter(
        tmp_path / "z.safetensors", {"a": (torch.float32, (1,)), "b": (torch.float32, (1,))}
    )
    incomplete.write("a", torch.ones(1))
    with pytest.raises(ValueError, match=r"never written: \['b'\]"):
        incomplete.close()


def _tp_split(full: torch.Tensor, dim: int, blocks: list[int], tp: int, rank: int) -> torch.Tensor:
    return torch.cat([torch.chunk(p, tp, dim=dim)[rank] for p in torch.split(full, blocks, dim=dim)], dim=dim)


def _write_checkpoint(root, tp: int, pp: int, full: dict, metas: dict, stage_of: dict, iteration: int = 7):
    """A checkpoint in the documented format, built with plain safetensors calls (independent of our writer)."""
    ckpt = root / f"iter_{iteration:07d}"
    (ckpt / "model").mkdir(parents=True)
    for t in range(tp):
        for p in range(pp):
            shard = {}
            for name, tensor in full.items():
                if stage_of[name] != p:
                    continue
                meta = metas[name]
                if meta["partition_dim"] is None:
                    shard[name] = tensor.clone()
                else:
                    blocks = meta["partition_blocks"] or [tensor.shape[meta["partition_dim"]]]
                    shard[name] = _tp_split(tensor, meta["partition_dim"], blocks, tp, t).contiguous()
            save_file(shard, str(ckpt / "model" / f"tp{t:02d}-pp{p:02d}.safetensors"))
    metadata = {
        "format": "mcore",
        "version": 1,
        "iteration": iteration,
        "layout": {"tp": tp, "pp": pp, "vpp": 1, "dp": 1},
        "model_config": {"hidden_size": 4},
        "train_config": None,
        "tensors": {n: {**m, "shape": list(full[n].shape), "dtype": "float32"} for n, m in metas.items()},
    }
    (ckpt / "metadata.json").write_text(json.dumps(metadata))
    (root / "latest").write_text(ckpt.name + "\n")
    return ckpt


@pytest.fixture
def saved(tmp_path):
    vocab, padded = 30, 32
    full = {
        "embedding.weight": torch.randn(padded, 4),
        "layers.0.mlp.gate_up.weight": torch.randn(16, 4),
        "layers.0.attention.out_proj.weight": torch.randn(4, 8),
        "layers.1.input_norm.weight": torch.randn(4),
    }
    metas = {
        "embedding.weight": dict(partition_dim=0, partition_blocks=None, vocab_padded_dim=0, vocab_size=vocab),
        "layers.0.mlp.gate_up.weight": dict(
            partition_dim=0, partition_blocks=[8, 8], vocab_padded_dim=None, vocab_size=None
        ),
        "layers.0.attention.out_proj.weight": dict(
            partition_dim=1, partition_blocks=None, vocab_padded_dim=None, vocab_size=None
        ),
        "layers.1.input_norm.weight": dict(
            partition_dim=None, partition_blocks=None, vocab_padded_dim=None, vocab_size=None
        ),
    }
    stage_of = {"embedding.weight": 0, "layers.0.mlp.gate_up.weight": 0}
    stage_of |= {"layers.0.attention.out_proj.weight": 0, "layers.1.input_norm.weight": 1}
    root = tmp_path / "checkpoints"
    ckpt = _write_checkpoint(root, tp=2, pp=2, full=full, metas=metas, stage_of=stage_of)
    return root, ckpt, full, metas


def test_reader_resolves_latest_and_reads_full_tensors(saved):
    root, ckpt, full, _ = saved
    assert resolve_checkpoint_dir(root) == ckpt
    assert resolve_checkpoint_dir(root.parent) == ckpt  # a run directory holding checkpoints/latest
    with CheckpointReader(root) as reader:
        assert reader.iteration == 7 and reader.layout.tp == 2 and reader.layout.pp == 2
        assert reader.tensor_names() == list(full)
        assert not reader.has_optimizer_state and reader.train_state is None
        emb = reader.read_full("embedding.weight")
        assert torch.equal(emb, full["embedding.weight"][:30])  # padding rows dropped
        assert torch.equal(reader.read_full("embedding.weight", padded=True), full["embedding.weight"])
        for name in list(full)[1:]:
            assert torch.equal(reader.read_full(name), full[name])


def test_reader_reshards_to_another_tp(saved):
    root, _, full, metas = saved
    name = "layers.0.mlp.gate_up.weight"
    with CheckpointReader(root) as reader:
        for rank in range(4):
            target = Target(full_shape=(16, 4), partition_dim=0, partition_blocks=(8, 8), tp_size=4, tp_rank=rank)
            got = reader.read_local(name, target)
            assert torch.equal(got, _tp_split(full[name], 0, [8, 8], 4, rank))


def test_unknown_tensor_name_suggests(saved):
    root, *_ = saved
    with CheckpointReader(root) as reader, pytest.raises(CheckpointError, match="did you mean 'embedding.weight'"):
        reader.read_full("embedding.weights")


def test_truncated_shard_is_a_checkpoint_error(saved):
    root, ckpt, *_ = saved
    shard = ckpt / "model" / "tp01-pp00.safetensors"
    shard.write_bytes(shard.read_bytes()[:-16])
    with CheckpointReader(root) as reader, pytest.raises(CheckpointError, match="corrupt or truncated"):
        reader.read_full("layers.0.mlp.gate_up.weight")


def test_missing_shard_is_a_checkpoint_error(saved):
    root, ckpt, *_ = saved
    (ckpt / "model" / "tp01-pp01.safetensors").unlink()
    with pytest.raises(CheckpointError, match="incomplete: missing model/tp01-pp01.safetensors"):
        CheckpointReader(root)


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda m: "{not json", "invalid JSON"),
        (lambda m: json.dumps({**m, "format": "other"}), "not an mcore checkpoint"),
        (lambda m: json.dumps({**m, "version": 99}), "version 99 is not supported"),
        (lambda m: json.dumps({**m, "layout": {"tp": 0, "pp": 1, "vpp": 1, "dp": 1}}), "bad layout"),
        (lambda m: json.dumps({**m, "tensors": {"x": {"shape": [2], "dtype": "float32", "partition_dim": 3}}}), "x"),
    ],
)
def test_corrupt_metadata_is_a_checkpoint_error(saved, mutate, match):
    _, ckpt, *_ = saved
    meta_path = ckpt / "metadata.json"
    meta_path.write_text(mutate(json.loads(meta_path.read_text())))
    with pytest.raises(CheckpointError, match=match):
        CheckpointReader(ckpt)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        CheckpointReader(tmp_path / "nothing")
    with pytest.raises(CheckpointError, match="not an mcore checkpoint"):
        CheckpointReader(tmp_path)


def test_directory_commit_latest_prune_and_stale_temp(tmp_path):
    d = CheckpointDirectory(tmp_path / "ckpts")
    d.root.mkdir()
    assert d.latest() is None
    for it in (10, 20, 30):
        tmp = d.new_temp_dir(it)
        tmp.mkdir()
        (tmp / "metadata.json").write_text("{}")
        d.commit(tmp, it, keep_last=2)
    assert [p.name for p in d.checkpoints()] == ["iter_0000020", "iter_0000030"]
    assert d.latest() == d.root / "iter_0000030"
    assert (d.root / "latest").read_text().strip() == "iter_0000030"
    stale = d.new_temp_dir(40)
    stale.mkdir()
    (stale / "half-written").write_text("x")
    assert d.latest() == d.root / "iter_0000030"  # an incomplete save is invisible
    assert d.remove_stale_temp_dirs() == [stale] and not stale.exists()


def test_model_writer_round_trip_and_padding(tmp_path):
    config = get_config("llama-tiny")
    model = GPTModel(config)
    model.init_weights(7)
    with ModelCheckpointWriter(tmp_path / "ckpt", config, dtype=torch.bfloat16) as writer:
        for name, param in model.named_parameters():
            full = param.detach()
            if getattr(param, "vocab_padded_dim", None) == 0:
                full = full[: config.vocab_size]  # unpadded, as Hugging Face holds it
            writer.add(name, full)
    with CheckpointReader(tmp_path / "ckpt") as reader:
        assert reader.model_config == config and reader.layout.tp == 1 and reader.iteration == 0
        assert not reader.has_optimizer_state and reader.train_config is None
        for name, param in model.named_parameters():
            got = reader.read_full(name)
            assert got.dtype == torch.bfloat16
            expected = param.detach()[: config.vocab_size] if name in ("embedding.weight", "output.weight") else param
            assert torch.equal(got, expected.detach().to(torch.bfloat16)), name
        padded = reader.read_full("embedding.weight", padded=True)
        assert padded.shape[0] == config.padded_vocab_size(1) and not padded[config.vocab_size :].any()


def test_model_writer_rejects_bad_input_and_publishes_nothing(tmp_path):
    config = get_config("llama-tiny")
    writer = ModelCheckpointWriter(tmp_path / "ckpt", config)
    with pytest.raises(KeyError, match="did you mean 'layers.0.mlp.gate_up.weight'"):
        writer.add("layers.0.mlp.gate_proj.weight", torch.zeros(1))
    with pytest.raises(ValueError, match=r"layers.0.mlp.down.weight: expected shape \[64, 176\], got \[176, 64\]"):
        writer.add("layers.0.mlp.down.weight", torch.zeros(176, 64))
    writer.add("final_norm.weight", torch.ones(64))
    with pytest.raises(ValueError, match="tensor\\(s\\) were never added"):
        writer.finalize()
    writer.abort()
    assert not list(tmp_path.iterdir())  # neither the checkpoint nor its temporary directory
    with pytest.raises(RuntimeError), ModelCheckpointWriter(tmp_path / "ckpt", config) as w:
        w.add("final_norm.weight", torch.ones(64))
        raise RuntimeError("conversion failed")
    assert not list(tmp_path.iterdir())
    (tmp_path / "taken").mkdir()
    with pytest.raises(FileExistsError, match="nothing is overwritten"):
        ModelCheckpointWriter(tmp_path / "taken", config)
