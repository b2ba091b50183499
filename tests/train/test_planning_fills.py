"""What the planner charges for the gradient buffers' fill and FSDP2's copies, against hand counts of what the code
does and against the code itself: DDP's ``zero_grad_buffer`` leaves unfilled the regions whose step's first
weight-gradient GEMM overwrites them (``skip_overwritten_fill``: the tensor-parallel linears, the output layer, the
expert weights) but fills the embedding, norms, biases, replicated linears and expert biases; FSDP2 at one rank
gathers once per step and copies only the gradients no GEMM writes (norms, the embedding), at several ranks every
micro-batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mcore.models.families import get_config
from mcore.train.planning.cluster import PRESETS, Network
from mcore.train.planning.layout import Layout
from mcore.train.planning.memory import stage_parameters
from mcore.train.planning.shape import ModelShape
from mcore.train.planning.step import predict_step
from mcore.train.planning.validation import SHAPE_8B4L, _moe_shape, _shape

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "s5-h200-2026-12-01"
H200 = Network(PRESETS["h200-node"])
GPU = H200.gpu
RECORDS = {
    "gptoss4l": RESULTS / "gptoss4l" / "mcore-grouped_fp32_wgrad_gptoss4l.json",
    "mixtral2l": RESULTS / "mix_bf16" / "mcore-per_expert_mixtral2l.json",
}


def _record(name: str) -> dict:
    return json.loads(RECORDS[name].read_text())


def _expert_weights(r: dict) -> int:
    """The routed experts' weight elements of a record (SwiGLU: gate and up fused, then down), by hand."""
    return r["layers"] * r["experts"] * 3 * r["hidden"] * r["moe_ffn"]


def _overwritten_dense(r: dict) -> int:
    """The tensor-parallel linears of a MoE record's layers (fused QKV and the output projection; the router is
    replicated) and its output layer (vocabularies of these records are multiples of 128: no padding), by hand."""
    q, kv = r["heads"] * r["head_dim"], r["kv"] * r["head_dim"]
    return r["layers"] * (r["hidden"] * (q + 2 * kv) + q * r["hidden"]) + r["vocab"] * r["hidden"]


@pytest.mark.parametrize("name", sorted(RECORDS))
@pytest.mark.parametrize("grads", ["fp32", "bf16"])
@pytest.mark.parametrize("gemm", ["grouped", "per_expert", "grouped_fp32_wgrad"])
def test_grad_zero_fills_all_but_the_expert_weights(name, grads, gemm):
    r = _record(name)
    shape = _moe_shape(r)
    layout = Layout(seq_length=r["seq"], distributed_optimizer=True, expert_gemm=gemm, main_grads_dtype=grads)
    filled = r["params"] - _expert_weights(r) - _overwritten_dense(r)  # embedding, norms, router, biases
    nbytes = {"fp32": 4, "bf16": 2}[grads] * filled
    got = predict_step(shape, layout, H200).breakdown["grad_zero"]
    assert got == pytest.approx(nbytes / (GPU.copy_gbps * 1e9), rel=1e-9)


def test_expert_biases_are_filled():
    r = _record("gptoss4l")
    biases = r["layers"] * r["experts"] * (2 * r["moe_ffn"] + r["hidden"])
    shape, layout = _moe_shape(r), Layout(seq_length=r["seq"], distributed_optimizer=True)
    dense_only = _moe_shape(r).total_parameters() - _expert_weights(r) - _overwritten_dense(r) - biases
    got = predict_step(shape, layout, H200).breakdown["grad_zero"] * GPU.copy_gbps * 1e9 / 4
    assert got - dense_only == pytest.approx(biases, rel=1e-9) and biases > 0


def test_a_dense_model_fills_only_its_embedding_and_norms():
    shape = _shape(SHAPE_8B4L, "8b4l")
    got = predict_step(shape, Layout(seq_length=4096), H200).breakdown["grad_zero"]
    h = SHAPE_8B4L["hidden"]
    filled = SHAPE_8B4L["vocab"] * h + (2 * SHAPE_8B4L["layers"] + 1) * h  # vocab 128256: a multiple of 128
    assert got == pytest.approx(4 * filled / (GPU.copy_gbps * 1e9), rel=1e-9)


def _filled_by_ddp(config) -> tuple[int, int]:
    """(elements ``zero_grad_buffer`` zeroes, elements it leaves unfilled) of a real model's gradient buffers after
    one step, counted by poisoning the buffers with NaN first (parameters only: the bucket padding is not a
    parameter's)."""
    import torch

    from mcore.models import GPTModel
    from mcore.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = GPTModel(config)
    ddp = DistributedDataParallel(model, None)
    ddp.zero_grad_buffer()
    ids = torch.randint(0, config.vocab_size, (2, 16))
    ddp(ids, labels=torch.roll(ids, -1, 1)).mean().backward()
    ddp.finish_grad_sync()
    for buf in ddp.grad_buffers:
        buf.grad_data.fill_(float("nan"))
    ddp.zero_grad_buffer()
    kept = [int(torch.isnan(p.main_grad).sum()) for p in model.parameters()]
    return sum(p.numel() for p in model.parameters()) - sum(kept), sum(kept)


@pytest.mark.parametrize("family,tied", [("llama", False), ("llama", True), ("mixtral", False), ("deepseek_v3", False)])
def test_the_planned_fill_is_what_ddp_fills(family, tied):
    from tests.helpers.families import tiny_config

    config = tiny_config(family, tie_word_embeddings=tied)
    shape = ModelShape.from_config(config)
    filled, unfilled = _filled_by_ddp(config)
    assert unfilled > 0
    chunks = [(0, shape.layers)]
    dense, expert = stage_parameters(shape, Layout(), 0, chunks)
    assert dense + expert == filled + unfilled  # the planner holds the model's parameters
    got = predict_step(shape, Layout(seq_length=16), H200).breakdown["grad_zero"] * GPU.copy_gbps * 1e9 / 4
    assert got == pytest.approx(filled, rel=1e-9)


def test_fsdp_has_no_buffer_fill():
    r = _record("mixtral2l")
    layout = Layout(seq_length=r["seq"], dp_shard=True, expert_gemm="per_expert")
    assert "grad_zero" not in predict_step(_moe_shape(r), layout, H200).breakdown


def _dp_shard_copy(shape: ModelShape, dp: int, micro_batches: int) -> float:
    layout = Layout(dp=dp, dp_shard=True, micro_batch=1, global_batch=dp * micro_batches, seq_length=4096)
    return predict_step(shape, layout, H200).breakdown["dp_shard_copy"]


def test_fsdp_at_one_rank_gathers_once_per_step_and_copies_only_unfused_gradients():
    shape = _shape(SHAPE_8B4L, "8b4l")
    h, layers, vocab = SHAPE_8B4L["hidden"], SHAPE_8B4L["layers"], SHAPE_8B4L["vocab"]
    unfused = layers * 2 * h + vocab * h  # the layers' two RMSNorms and the embedding (no GEMM writes them)
    gathered = shape.total_parameters() - h  # every unit's parameters (the final norm is the root's)
    nbytes = gathered * (4 + 2 + 2 * 2) + unfused * (2 + 4 + 4)  # cast + copy-out; cast + two fp32 copies
    for micro_batches in (1, 4):
        assert _dp_shard_copy(shape, 1, micro_batches) == pytest.approx(GPU.memory_seconds(nbytes), rel=1e-9)


def test_fsdp_at_several_ranks_gathers_and_reduces_every_micro_batch():
    shape = _shape(SHAPE_8B4L, "8b4l")
    one, four = _dp_shard_copy(shape, 2, 1), _dp_shard_copy(shape, 2, 4)
    assert four == pytest.approx(4 * one, rel=1e-9)
    assert one > _dp_shard_copy(shape, 1, 1)  # re-gathered for backward, every gradient copied


def test_tied_output_layer_adds_no_copies_at_one_rank():
    """A tied output layer is the embedding's weight: no unit of its own, nothing gathered twice."""
    tied = ModelShape.from_config(get_config("llama3.2-1b"))
    assert tied.tied
    untied = ModelShape(**{**tied.__dict__, "tied": False})
    vocab_bytes = tied.padded_vocab(1) * tied.hidden * (4 + 2 + 2 * 2)  # the output layer's gather
    assert _dp_shard_copy(untied, 1, 1) - _dp_shard_copy(tied, 1, 1) == pytest.approx(
        GPU.memory_seconds(vocab_bytes), rel=1e-6
    )


def _expert_memory_ms(r: dict, **layout) -> float:
    """The ``memory`` seconds of a record's step under ``layout``, in ms."""
    lay = Layout(seq_length=r["seq"], distributed_optimizer=not layout.get("dp_shard"), **layout)
    return predict_step(_moe_shape(r), lay, H200).breakdown["memory"] * 1e3


@pytest.mark.parametrize("grads, target", [("fp32", 4), ("bf16", 2)])
def test_grouped_weight_gradients_are_copied_into_main_grad(grads, target):
    """``torch._grouped_mm`` gives a bf16 weight gradient that ``wgrad_into`` copies into ``main_grad`` (first
    micro-batch: read 2, write the target; later ones add: read 2, read and write the target); the per-expert
    GEMMs write it themselves."""
    r = _record("mixtral2l")
    copied = _expert_memory_ms(r, expert_gemm="grouped", main_grads_dtype=grads)
    written = _expert_memory_ms(r, expert_gemm="grouped_fp32_wgrad", main_grads_dtype=grads)
    assert copied - written == pytest.approx(GPU.memory_seconds((2 + target) * _expert_weights(r)) * 1e3, rel=1e-9)
    four = Layout(seq_length=r["seq"], distributed_optimizer=True, global_batch=4, main_grads_dtype=grads)
    per_mb = {gemm: predict_step(_moe_shape(r), four.replace(expert_gemm=gemm), H200).breakdown["memory"] for gemm in
              ("grouped", "grouped_fp32_wgrad")}  # fmt: skip
    step_bytes = (2 + target + 3 * (2 + 2 * target)) * _expert_weights(r)
    assert per_mb["grouped"] - per_mb["grouped_fp32_wgrad"] == pytest.approx(GPU.memory_seconds(step_bytes), rel=1e-9)


def test_fsdp_at_one_rank_copies_grouped_gradients_into_the_fp32_shards():
    r = _record("mixtral2l")
    copied = _expert_memory_ms(r, expert_gemm="grouped", dp_shard=True, main_grads_dtype="bf16")
    written = _expert_memory_ms(r, expert_gemm="per_expert", dp_shard=True, main_grads_dtype="bf16")
    assert copied - written == pytest.approx(GPU.memory_seconds(6 * _expert_weights(r)) * 1e3, rel=1e-9)
