"""mcore-train with MoE models: expert-layout errors name valid values; a dropless run gives the same losses at
ep=1 and ep=2 (2 gloo ranks), aux loss and expert-bias balancing included."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mcore.train.config import load_config
from mcore.train.errors import UserError
from tests.helpers.distributed import run_workers
from tests.train.tiny import TINY

MOE = [
    "model=mixtral-tiny",
    "model.router_aux_loss_coef=0.01",
    "model.moe_router={z_loss_coef: 0.001, expert_bias: true, bias_update_rate: 0.01}",
    "train.steps=4",
    "checkpoint.save_at_end=false",
]


def _losses(rank: int, world: int, run_root: str) -> dict:
    from tests.train.tiny import train, train_records

    out = {}
    for ep in (1, 2):
        run_dir = f"{run_root}/ep{ep}"
        train(run_dir, *MOE, f"parallel.ep={ep}")
        out[ep] = [r["loss"] for _, r in sorted(train_records(run_dir).items())]
    # the per-expert GEMMs on each ep rank's local experts (offsets of the received rows)
    run_dir = f"{run_root}/ep2-per-expert"
    router = "{z_loss_coef: 0.001, expert_bias: true, bias_update_rate: 0.01, expert_gemm: per_expert}"
    train(run_dir, *MOE, "parallel.ep=2", f"model.moe_router={router}")
    out["ep2-per-expert"] = [r["loss"] for _, r in sorted(train_records(run_dir).items())]
    return out


# name -> overrides on 4 ranks (global batch 8 of micro-batches of 2); "dp4" is the reference
LAYOUTS4 = {
    "dp4": [],
    "ep4": ["parallel.ep=4"],
    "ep2-distopt": ["parallel.ep=2", "parallel.distributed_optimizer=true"],
    "tp2-sp-ep2": ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=2"],
    "tp2-ep2-etp1": ["parallel.tp=2", "parallel.ep=2", "parallel.etp=1"],
    "pp2-ep2": ["parallel.pp=2", "parallel.ep=2"],
    # FSDP2 (ZeRO-3) at ep 1: the experts sharded with the rest over dp, fp32 shards as the master weights
    "dp4-shard": ["parallel.dp_shard=true"],
    "dp4-shard-per-expert": [
        "parallel.dp_shard=true",
        "model.moe_router={z_loss_coef: 0.001, expert_bias: true, bias_update_rate: 0.01, expert_gemm: per_expert}",
    ],
}


def _layout_losses(rank: int, world: int, run_root: str) -> dict:
    from tests.train.tiny import train, train_records

    out = {}
    for name, overrides in LAYOUTS4.items():
        run_dir = f"{run_root}/{name}"
        # 4 layers so that pp2 has two per stage; the aux losses and bias update on, as in training
        train(run_dir, *MOE, "model.num_hidden_layers=4", "train.global_batch_size=8", *overrides)
        out[name] = [r["loss"] for _, r in sorted(train_records(run_dir).items())]
    return out


def test_tp_pp_dp_with_ep_equal_plain_data_parallel(tmp_path):
    losses = run_workers(4, _layout_losses, str(tmp_path))[0]
    reference = losses["dp4"]
    assert len(reference) == 4
    for name, got in losses.items():
        for a, b in zip(got, reference):
            assert abs(a - b) <= 1e-5 * abs(b), (name, got, reference)


def test_moe_load_statistics_are_logged(tmp_path):
    from tests.train.tiny import train, train_records

    train(tmp_path, *MOE, "model.moe_router={z_loss_coef: 0.001, capacity_factor: 0.5}")
    record = train_records(tmp_path)[4]
    assert record["moe_max_load"] >= 1.0 and record["moe_dropped"] > 0  # capacity 0.5 must drop
    assert record["moe_aux_loss"] > 0 and record["moe_z_loss"] > 0


def test_dropless_losses_do_not_depend_on_ep(tmp_path):
    results = run_workers(2, _losses, str(tmp_path))
    losses = results[0]
    assert len(losses[1]) == 4 and losses[1][0] > losses[1][-1]
    for a, b in zip(losses[1], losses[2]):
        assert abs(a - b) <= 1e-5 * abs(a), (losses[1], losses[2])
    for a, b in zip(losses["ep2-per-expert"], losses[2], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (losses["ep2-per-expert"], losses[2])


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["parallel.ep=3"], r"num_experts=4 not divisible by ep=3; valid ep: \[1, 2, 4\]"),
        (["parallel.etp=5"], r"moe_intermediate_size=96 not divisible by etp=5; valid etp: \[1, 2, 4, 8, 16, 32\]"),
        (["model=llama-tiny", "parallel.ep=2"], "need an MoE model"),
        (["model.moe_router={capacity: 1.0}"], r"unknown keys \['capacity'\]; valid keys"),
        (["parallel.ep=2", "parallel.dp_shard=true"], "does not reduce expert parameters over the expert grid"),
    ],
)
def test_bad_expert_layouts_name_valid_values(overrides, match):
    with pytest.raises(UserError, match=match):
        load_config(None, [*TINY, *MOE, *overrides])


EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("name,experts,tp", [("mixtral-8x7b.yaml", 8, 8), ("qwen3-30b-a3b.yaml", 128, 4)])
def test_moe_examples_load(name, experts, tp):
    config = load_config(EXAMPLES / name)
    assert config.model.num_experts == experts and config.parallel.tp == tp
    assert config.model.mlp_type(0) == "moe" and config.model.router_aux_loss_coef > 0


def test_per_expert_gemm_trains_like_grouped(tmp_path):
    from tests.train.tiny import train, train_records

    losses = {}
    for gemm in ("grouped", "per_expert"):
        train(tmp_path / gemm, *MOE, f"model.moe_router={{expert_gemm: {gemm}}}")
        losses[gemm] = [r["loss"] for _, r in sorted(train_records(tmp_path / gemm).items())]
    assert len(losses["grouped"]) == 4
    for a, b in zip(losses["per_expert"], losses["grouped"]):
        assert abs(a - b) <= 1e-5 * abs(b), losses


def _one_rank_fsdp_per_expert(rank: int, world: int, run_root: str) -> dict:
    """One gloo rank: FSDP2 at dp=1 with per-expert GEMMs, counting the weight-gradient GEMMs of the experts that
    accumulate into an fp32 buffer (the shards' gradients: FSDP's dp=1 fusion), and ZeRO-1 alike."""
    import mcore.parallel.expert_gemm as expert_gemm
    from tests.train.tiny import train, train_records

    real = expert_gemm.accumulate_weight_grad_
    out: dict = {}
    router = "{expert_gemm: per_expert}"
    for name, layout in (("zero1", ["parallel.distributed_optimizer=true"]), ("fsdp", ["parallel.dp_shard=true"])):
        fused: list[torch.dtype] = []
        expert_gemm.accumulate_weight_grad_ = lambda t, *a, seen=fused: seen.append(t.dtype) or real(t, *a)
        try:
            train(f"{run_root}/{name}", *MOE, f"model.moe_router={router}", *layout)
        finally:
            expert_gemm.accumulate_weight_grad_ = real
        out[name] = ([r["loss"] for _, r in sorted(train_records(f"{run_root}/{name}").items())], fused)
    return out


def test_fsdp_at_one_rank_fuses_the_per_expert_weight_gradients(tmp_path):
    out = run_workers(1, _one_rank_fsdp_per_expert, str(tmp_path))[0]
    (zero1, fused_zero1), (fsdp, fused_fsdp) = out["zero1"], out["fsdp"]
    assert len(fsdp) == 4 and fsdp == pytest.approx(zero1, rel=1e-5)
    # every step's expert weight gradients went into fp32 buffers inside the GEMM, under both layouts
    assert len(fused_fsdp) == len(fused_zero1) > 0 and set(fused_fsdp) == {torch.float32}
