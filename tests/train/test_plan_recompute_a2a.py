"""``mcore-train plan`` for ``train.recompute_modules`` (each module's activation term against what the model
stops saving, the recomputed forward in the step time), the all-to-all bytes per step of MoE configs (computed
by hand on a tiny config), ``--gpus`` as the world size, and the DeepSeek-V3 example fitting an 80 GB H100."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from mcore.models.gpt import GPTModel
from mcore.train.cli import main
from mcore.train.config import load_config
from mcore.train.plan import make_plan
from mcore.train.planning.calibration import load_calibration
from mcore.train.planning.cluster import Network, load_cluster
from mcore.train.planning.layout import Layout
from mcore.train.planning.memory import activation_bytes_per_layer
from mcore.train.planning.shape import ModelShape
from mcore.train.planning.time_model import TimeModel

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "deepseek-v3-1024-h100.yaml"
TINY = ["model=deepseek_v3-tiny", "model.q_lora_rank=null", "data.seq_length=64", "train.precision=fp32"]


def _saved_bytes(layer, *args) -> int:
    """Bytes of the distinct non-parameter storages autograd keeps for backward during ``layer(*args)``."""
    storages: dict[int, int] = {}

    def pack(t):
        if not isinstance(t, torch.nn.Parameter):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(*args)
    return sum(storages.values())


def _measured(config, modules, index: int) -> int:
    recompute = None if modules is None else "selective"
    model = GPTModel(config.model, recompute=recompute, recompute_modules=modules)
    model.init_weights(0)
    ids = torch.randint(0, config.model.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    hidden = model.embedding(ids.t()).detach().requires_grad_(True)
    rope = model.rotary(torch.arange(64).expand(2, 64))
    return _saved_bytes(model.layers[str(index)], hidden, rope)


@pytest.mark.parametrize("module", ["layernorm", "mla_up_proj", "core_attn", "mlp", "moe", "shared_experts"])
def test_each_modules_term_is_what_the_model_stops_saving(module, monkeypatch):
    if module in ("mla_up_proj", "core_attn"):
        # a flash kernel, as on the GPU: it saves q, k, v as given and the log-sum-exp (CPU SDPA saves copies)
        monkeypatch.setenv("MCORE_KERNELS_BACKEND", "triton")
    config = load_config(None, TINY)
    index = 0 if module == "mlp" else 1  # layer 0 is dense, the others MoE
    shape = ModelShape.from_config(config.model)
    none = Layout(micro_batch=2, global_batch=2, seq_length=64, precision="fp32")
    with_module = dataclasses.replace(none, recompute="selective", recompute_modules=(module,))
    predicted = activation_bytes_per_layer(shape, none, index, 4) - activation_bytes_per_layer(
        shape, with_module, index, 4
    )
    measured = _measured(config, None, index) - _measured(config, [module], index)
    assert measured > 0 and 0.7 * measured <= predicted <= 1.3 * measured, (predicted, measured)


def test_recomputed_moe_runs_its_all_to_alls_again_in_backward():
    shape = ModelShape.from_config(load_config(None, ["model=deepseek_v3-tiny"]).model)
    network = Network(load_cluster("h200-node"))
    base = Layout(dp=2, ep=2, micro_batch=2, global_batch=8, seq_length=64, recompute="selective")
    plain = TimeModel(shape, dataclasses.replace(base, recompute_modules=("mla_up_proj",)), network).layer_cost(1)
    moe = TimeModel(shape, dataclasses.replace(base, recompute_modules=("mla_up_proj", "moe")), network).layer_cost(1)
    assert moe.forward == plain.forward
    assert moe.backward["ep_comm"] == pytest.approx(plain.backward["ep_comm"] + plain.forward["ep_comm"])
    assert moe.backward["gemm"] > plain.backward["gemm"]


def test_layout_takes_the_list_and_writes_it_back():
    layout = Layout(recompute="selective", recompute_modules=["mla_up_proj", "mlp"])
    assert layout.recompute_modules == ("mla_up_proj", "mlp")
    assert "train.recompute_modules=[mla_up_proj,mlp]" in layout.overrides()
    assert dataclasses.replace(layout, recompute="full").recompute_modules is None  # the memory modes switch it
    with pytest.raises(ValueError, match=r"unknown recompute_modules \['up'\]"):
        Layout(recompute="selective", recompute_modules=("up",))


def _tiny_moe_plan(extra=()):
    # 2 layers, layer 0 dense: one MoE layer; hidden 64, top-2; 64 tokens per micro-batch; dp 2 x ep 2
    config = load_config(
        None,
        [*TINY, "train.micro_batch_size=1", "train.global_batch_size=8", "parallel.ep=2", "model.num_hidden_layers=2",
         *extra],
    )  # fmt: skip
    return make_plan(config, 2, gpu_memory_gb=80)


def test_all_to_all_bytes_by_hand():
    plan = _tiny_moe_plan()
    (t,) = plan.ep_traffic
    one = 64 * 2 * 64 * 4  # tokens x top_k x hidden x fp32 bytes
    micro = 8 // 2  # global batch over dp 2
    assert (t.moe_layers, t.microbatches, t.exchange_bytes) == (1, micro, one)
    assert t.dispatch_forward == t.combine_forward == micro * one
    assert t.backward == 2 * micro * one and t.recompute == 0
    assert t.off_gpu == 4 * micro * one / 2
    (full,) = _tiny_moe_plan(["train.recompute=full"]).ep_traffic
    assert full.recompute == 2 * micro * one
    (moe,) = _tiny_moe_plan(["train.recompute=selective", "train.recompute_modules=[moe]"]).ep_traffic
    assert moe.recompute == 2 * micro * one


def test_plan_prints_and_writes_the_all_to_all_bytes(capsys):
    args = ["plan", *TINY, "train.micro_batch_size=1", "train.global_batch_size=8", "parallel.ep=2",
            "model.num_hidden_layers=2", "--gpus", "2"]  # fmt: skip
    assert main(args) == 0
    text = capsys.readouterr().out
    one = 64 * 2 * 64 * 4  # 32,768 B; 4 micro-batches: 131,072 B per direction
    assert "1 MoE layer(s) x 4 micro-batch(es), 32.8 kB per exchange)" in text
    assert "dispatch 131.1 kB + combine 131.1 kB forward, 262.1 kB backward = 524.3 kB, 262.1 kB of it" in text
    assert main([*args, "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["all_to_all_bytes"]
    assert row["dispatch_forward"] == 4 * one and row["total"] == 16 * one and row["off_gpu"] == 8 * one
    assert main(["plan", *TINY, "--gpus", "1"]) == 0
    assert "all-to-all" not in capsys.readouterr().out  # ep 1: no exchange


def test_gpus_is_the_world_size_without_search(capsys):
    base = ["plan", *TINY, "train.micro_batch_size=2", "train.global_batch_size=8", "--json"]
    assert main([*base, "--gpus", "4"]) == 0
    assert json.loads(capsys.readouterr().out)["world_size"] == 4
    assert main([*base, "--gpus", "4", "--world-size", "4"]) == 0
    capsys.readouterr()
    assert main([*base, "--gpus", "4", "--world-size", "2"]) != 0
    assert "--gpus 4 and --world-size 2 disagree" in capsys.readouterr().err


def test_deepseek_v3_example_fits_an_80gb_h100():
    config = load_config(EXAMPLE)
    assert config.train.recompute_modules == ["mla_up_proj", "mlp", "layernorm"]
    calibration = load_calibration("h100-sxm")
    plan = make_plan(config, 1024, calibration.memory_gb, Network(load_cluster("dgx-h100"), calibration))
    assert plan.fits, plan.worst.total / 1e9
    megatron = load_config(EXAMPLE, ["train.recompute_modules=[mla_up_proj,mlp]", "optim.offload_fraction=0"])
    assert not make_plan(megatron, 1024, calibration.memory_gb).fits  # bf16 experts' rows: see the header
    assert max(t.total for t in plan.ep_traffic) > 0
