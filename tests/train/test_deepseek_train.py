"""mcore-train with DeepSeek-V3 models (MLA, sigmoid group-limited routing with the aux-loss-free bias, shared experts,
a dense first layer, MTP): tp2, tp2 with sequence parallelism, pp2 (MTP on the last stage), ep2 and tp2 x ep2 on 4
gloo ranks give the single process's losses over several AdamW steps, also with selective recompute by module
(tp2 SP, tp2 x ep2), and the expert biases evolve identically; the biases are saved in checkpoints and restored on
resume."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import run_workers

DEEPSEEK = [
    "model=deepseek_v3-tiny",
    "model.num_hidden_layers=4",
    "model.num_nextn_predict_layers=1",
    "model.moe_router={score_function: sigmoid, expert_bias: true, n_group: 4, topk_group: 2, "
    "routed_scaling_factor: 2.5, bias_update_rate: 0.01, aux_loss_type: sequence}",
    "model.router_aux_loss_coef=0.01",
    "train.mtp_loss_weight=0.3",
    "train.steps=4",
    "train.global_batch_size=8",
]
# name -> overrides on 4 ranks (global batch 8 of micro-batches of 2)
LAYOUTS = {
    "tp2": ["parallel.tp=2"],
    "tp2-sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "pp2": ["parallel.pp=2"],
    "ep2": ["parallel.ep=2", "parallel.distributed_optimizer=true"],
    "tp2-ep2": ["parallel.tp=2", "parallel.ep=2"],
    # recompute by module (collectives inside the recomputed regions: SP gathers, the MoE all-to-alls, aux-loss
    # all-reduces) against the single process without recompute; the biases must count each token once
    "tp2-sp-recompute": ["parallel.tp=2", "parallel.sequence_parallel=true", "train.recompute=selective",
                         "train.recompute_modules=[mla_up_proj,layernorm,mlp,shared_experts]"],
    "tp2-ep2-recompute": ["parallel.tp=2", "parallel.ep=2", "train.recompute=selective",
                          "train.recompute_modules=[mla_up_proj,moe,layernorm]"],
}  # fmt: skip


def _run(run_dir, *overrides) -> tuple[list[float], dict[str, torch.Tensor]]:
    """(losses by step, this rank's expert biases at the end) of one mcore-train run in this process."""
    from tests.train.tiny import train_keeping_trainer, train_records

    trainer = train_keeping_trainer(run_dir, *DEEPSEEK, *overrides)
    biases = {name: b.detach().clone() for name, b, _ in trainer.named_local_buffers() if name.endswith("expert_bias")}
    return [r["loss"] for _, r in sorted(train_records(run_dir).items())], biases


def _layouts(rank: int, world: int, run_root: str) -> dict:
    return {
        name: _run(f"{run_root}/{name}", "checkpoint.save_at_end=false", *overrides)
        for name, overrides in LAYOUTS.items()
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("single"), "checkpoint.save_at_end=false")


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    return run_workers(4, _layouts, str(tmp_path_factory.mktemp("layouts")))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_equals_the_single_process(reference, layouts, layout):
    ref_losses, ref_biases = reference
    assert len(ref_losses) == 4 and len(ref_biases) == 4  # 3 MoE layers and the MTP layer
    assert any(b.abs().sum() > 0 for b in ref_biases.values())  # the bias moved
    for rank, results in enumerate(layouts):
        losses, biases = results[layout]
        for a, b in zip(losses, ref_losses):
            assert abs(a - b) <= 1e-5 * abs(b), (layout, rank, losses, ref_losses)
        assert biases, (layout, rank)
        for name, bias in biases.items():  # each rank holds its stage's layers, with every expert's bias
            assert torch.equal(bias, ref_biases[name]), (layout, rank, name)


def test_expert_biases_are_checkpointed_and_resumed(tmp_path):
    from mcore.train.checkpoint import CheckpointReader

    run = tmp_path / "run"
    _, biases = _run(run, "train.stop_at_step=2")
    with CheckpointReader(run / "checkpoints" / "latest") as reader:
        for name, bias in biases.items():
            assert torch.equal(reader.read_full(name).float(), bias), name
    resumed, _ = _run(run, f"checkpoint.load={run / 'checkpoints'}")
    straight, _ = _run(tmp_path / "straight", "checkpoint.save_at_end=false")
    assert resumed[-2:] == pytest.approx(straight[-2:], rel=1e-6)
