"""``plan`` against real models: parameters per pipeline stage and the activation bytes autograd keeps."""

from __future__ import annotations

import pytest
import torch

from mcore.models.gpt import GPTModel
from mcore.train.config import load_config
from mcore.train.plan import activation_bytes_per_layer, make_plan


def _stage_numel(config, pp: int, rank: int) -> int:
    layers = config.model.num_hidden_layers // pp
    model = GPTModel(
        config.model,
        layer_range=(rank * layers, (rank + 1) * layers),
        pre_process=rank == 0,
        post_process=rank == pp - 1,
        device="meta",
    )
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("pp", [1, 2])
def test_parameters_per_stage_match_the_model(pp, tied):
    config = load_config(
        None,
        [
            "model=llama3-8b",
            f"model.tie_word_embeddings={str(tied).lower()}",
            f"parallel.pp={pp}",
            "data.seq_length=1024",
        ],
    )
    plan = make_plan(config, world_size=pp, gpu_memory_gb=80)
    for stage in plan.stages:  # a tied model's last stage holds its own copy of the embedding
        assert stage.parameters == _stage_numel(config, pp, stage.pp_rank), stage.pp_rank


def test_memory_components_follow_precision_and_distributed_optimizer():
    base = ["model=llama-tiny", "data.seq_length=32", "train.global_batch_size=8", "train.micro_batch_size=2"]
    bf16 = make_plan(load_config(None, [*base, "train.precision=bf16"]), world_size=4, gpu_memory_gb=80).stages[0]
    assert bf16.weights == 2 * bf16.parameters and bf16.gradients == 4 * bf16.parameters
    assert bf16.optimizer == 12 * bf16.parameters  # fp32 master + two Adam moments
    fp32 = make_plan(load_config(None, [*base, "train.precision=fp32"]), world_size=4, gpu_memory_gb=80).stages[0]
    assert fp32.optimizer == 8 * fp32.parameters  # the fp32 parameters are their own masters
    zero = make_plan(
        load_config(None, [*base, "train.precision=bf16", "parallel.distributed_optimizer=true"]),
        world_size=4,
        gpu_memory_gb=80,
    ).stages[0]
    assert zero.optimizer == pytest.approx(bf16.optimizer / 4)


def _saved_bytes(module: torch.nn.Module, *args) -> int:
    """Bytes of the distinct storages autograd saves for backward during ``module(*args)``."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor):
        if t.device.type != "meta" and not isinstance(t, torch.nn.Parameter):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(*args)
    return sum(storages.values())


def test_activation_estimate_is_close_to_what_autograd_saves():
    config = load_config(
        None,
        [
            "model=llama-tiny",
            "model.num_hidden_layers=4",
            "data.seq_length=64",
            "train.micro_batch_size=2",
            "train.global_batch_size=2",
            "train.precision=fp32",
        ],
    )
    model = GPTModel(config.model)
    model.init_weights(0)
    ids = torch.randint(0, config.model.vocab_size, (2, 64))
    hidden = model.embedding(ids.t()).detach().requires_grad_(True)
    layer = model.layers["1"]
    rope = model.rotary(torch.arange(64).expand(2, 64))
    measured = _saved_bytes(layer, hidden, rope)
    estimate = activation_bytes_per_layer(config, tp=1, dtype_bytes=4)
    assert 0.7 * measured <= estimate <= 1.3 * measured, (estimate, measured)


def test_low_precision_is_said_to_be_planned_as_bf16():
    """fp8 / fp4 / BitNet runs are planned at bf16 rates: the report says so (and what it leaves out), a bf16
    config's report has no such note."""
    from mcore.train.plan_report import format_plan, plan_to_dict

    base = ["model=llama-tiny", "data.seq_length=32", "parallel.distributed_optimizer=true"]
    fp8 = make_plan(load_config(None, [*base, "train.precision=fp8", "fp8.param_gather=true"]), 1, 80)
    assert len(fp8.notes) == 1 and "train.precision=fp8 is planned as bf16" in fp8.notes[0]
    assert "fp8.param_gather" in fp8.notes[0] and f"note: {fp8.notes[0]}" in format_plan(fp8)
    assert plan_to_dict(fp8)["notes"] == list(fp8.notes)
    bitnet = make_plan(load_config(None, [*base, "train.quant=bitnet"]), 1, 80)
    assert "train.quant=bitnet is planned as bf16" in bitnet.notes[0]
    bf16 = make_plan(load_config(None, [*base, "train.precision=bf16"]), 1, 80)
    assert bf16.notes == () and "note:" not in format_plan(bf16)
