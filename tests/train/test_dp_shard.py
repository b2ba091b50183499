"""``parallel.dp_shard`` (ZeRO-3 on FSDP2) through mcore-train: training, checkpoints, resume across layouts.

- one gloo rank (the ``auto`` settings at dp=1: layers kept gathered, 8 micro-batches reduced once per step, the
  weight-gradient GEMMs accumulating into the fp32 shard gradients; also with full recompute, tied embeddings, and
  a MoE model with grouped or per-expert GEMMs), two (pp=2 x dp=1, tied embeddings) and four, llama-tiny in fp32:
  dp=4, tp=2 x dp=2, pp=2 x dp=2 (tied embeddings) and pp=2 x vpp=2 x dp=2 (interleaved 1F1B, two sharded chunks
  per rank; 4 layers) give the single-process losses within 1e-5 over 4 steps; stopping at step 2 and resuming at
  dp=4 gives the straight run bit for bit;
- resharding: the dp=4 ZeRO-3 checkpoint loaded at ZeRO-1 dp=2 and saved again, then loaded at ZeRO-3
  tp=2 x dp=1 and saved again, holds bit for bit the same weights and optimizer states;
- at dp=2 it composes with full recompute, and with selective recompute plus activation offload (the same losses);
- bf16 (FSDP's mixed-precision policy, fp32 shards and reductions) at dp=2 trains like the single-process bf16 run,
  evaluates, and samples at the end of the run through the sharded model;
- bad combinations are refused by the config with the fix named.
"""

from __future__ import annotations

import pytest
import torch

from mcore.train.checkpoint import CheckpointReader
from mcore.train.config import load_config
from tests.helpers.distributed import run_workers
from tests.train.tiny import train, train_records

STEPS = ["train.steps=4", "train.global_batch_size=8", "train.micro_batch_size=1"]
SHARD = "parallel.dp_shard=true"
TIED = "model.tie_word_embeddings=true"
BF16 = ["train.steps=4", "train.precision=bf16"]
LAYERS_4 = "model.num_hidden_layers=4"
MOE = ["model=mixtral-tiny"]
PER_EXPERT = "model.moe_router={expert_gemm: per_expert}"
COMPOSED = {
    "dp2_recompute_full": ["train.recompute=full"],
    "dp2_selective_act_offload": ["train.recompute=selective", "train.activation_offload=[attention,mlp]"],
}


def _four_rank_cases(rank: int, world_size: int, base):
    out = {}
    for name, extra in {
        "dp4": [],
        "tp2_dp2": ["parallel.tp=2"],
        "pp2_dp2_tied": ["parallel.pp=2", TIED],
        "pp2_vpp2_dp2_4layers": ["parallel.pp=2", "parallel.vpp=2", LAYERS_4],
    }.items():
        train(base / name, *STEPS, SHARD, *extra)
        out[name] = train_records(base / name) if rank == 0 else None
    train(base / "resumed", *STEPS, SHARD, "train.stop_at_step=2")
    _, log = train(base / "resumed", *STEPS, SHARD)
    out["resumed"] = train_records(base / "resumed") if rank == 0 else None
    out["resumed_log"] = log
    out["checkpoint"] = str(base / "resumed" / "checkpoints" / "iter_0000002")
    return out


def _one_rank_case(rank: int, world_size: int, base):
    train(base / "dp1", *STEPS, SHARD)
    train(base / "dp1_recompute_full", *STEPS, SHARD, "train.recompute=full")
    # the tied output layer's GEMM accumulates into the embedding's shard gradient, FSDP adds the embedding's own
    train(base / "dp1_tied", *STEPS, SHARD, TIED)
    # MoE experts (grouped GEMMs; per-expert GEMMs accumulating into the shard gradients like the linears)
    train(base / "dp1_moe", *STEPS, SHARD, *MOE)
    train(base / "dp1_moe_per_expert", *STEPS, SHARD, *MOE, PER_EXPERT)
    names = ("dp1", "dp1_recompute_full", "dp1_tied", "dp1_moe", "dp1_moe_per_expert")
    return {name: train_records(base / name) for name in names}


def _save_after_loading(base, name, load, *extra):
    """Build the trainer from checkpoint ``load`` and save it straight away (no step) into ``base / name``."""
    from mcore.train.checkpoint.directory import CheckpointDirectory
    from mcore.train.checkpoint.state import CheckpointSaver
    from mcore.train.loop import build_trainer
    from mcore.train.runtime import init_runtime
    from tests.train.tiny import TINY

    config = load_config(None, [*TINY, *STEPS, *extra])
    runtime = init_runtime(config)
    trainer = build_trainer(config, runtime, load=load).trainer
    CheckpointSaver(trainer, CheckpointDirectory(base / name), keep_last=1, async_save=False).save(None)
    return str(base / name / "iter_0000002")


def _two_rank_cases(rank: int, world_size: int, base, checkpoint):
    zero1 = _save_after_loading(base, "zero1_dp2", checkpoint, "parallel.distributed_optimizer=true")
    zero3 = _save_after_loading(base, "zero3_tp2", zero1, SHARD, "parallel.tp=2")
    # the memory modes that compose with it: full recompute; selective recompute with activation offload
    composed = {}
    for name, extra in COMPOSED.items():
        train(base / name, *STEPS, SHARD, *extra)
        composed[name] = train_records(base / name) if rank == 0 else None
    # two pipeline stages of one dp rank each: the dp=1 settings on every stage, the tied embedding's copies summed
    train(base / "pp2_dp1_tied", *STEPS, SHARD, "parallel.pp=2", TIED)
    pp2_dp1 = train_records(base / "pp2_dp1_tied") if rank == 0 else None
    # with an evaluation and the end-of-run sample (generation through the sharded model, a bf16 KV cache)
    bf16, _ = train(base / "bf16", *BF16, SHARD, "train.eval_interval=2", "train.sample_tokens=4")
    return {
        "zero1": zero1,
        "zero3": zero3,
        "bf16": train_records(base / "bf16") if rank == 0 else None,
        "bf16_sample": bf16.sample,
        "bf16_val_loss": bf16.val_loss,
        "pp2_dp1_tied": pp2_dp1,
        **composed,
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    base = tmp_path_factory.mktemp("dp_shard")
    single = base / "single"
    train(single, *STEPS)
    train(base / "single_tied", *STEPS, TIED)
    train(base / "single_4layers", *STEPS, LAYERS_4)
    train(base / "single_moe", *STEPS, *MOE)
    train(base / "single_bf16", *BF16)
    four = run_workers(4, _four_rank_cases, base)
    four[0].update(run_workers(1, _one_rank_case, base)[0])
    two = run_workers(2, _two_rank_cases, base, four[0]["checkpoint"])[0]
    four[0]["pp2_dp1_tied"] = two.pop("pp2_dp1_tied")
    singles = {name: train_records(base / f"single{name}") for name in ("", "_tied", "_4layers", "_moe")}
    return singles, train_records(base / "single_bf16"), four[0], two


@pytest.mark.parametrize(
    "layout",
    [
        *("dp1", "dp1_recompute_full", "dp1_tied", "dp1_moe", "dp1_moe_per_expert", "pp2_dp1_tied"),
        *("dp4", "tp2_dp2", "pp2_dp2_tied", "pp2_vpp2_dp2_4layers"),
    ],
)
def test_dp_shard_trains_like_one_process(results, layout):
    singles, _, four, _ = results
    single = singles[next((k for k in ("_tied", "_4layers", "_moe") if k[1:] in layout), "")]
    got = four[layout]
    assert sorted(got) == sorted(single) == list(range(1, 5))
    for step in range(1, 5):
        assert got[step]["loss"] == pytest.approx(single[step]["loss"], rel=1e-5, abs=0), (layout, step)
        assert got[step]["grad_norm"] == pytest.approx(single[step]["grad_norm"], rel=1e-5, abs=0), (layout, step)
    assert got[4]["loss"] < got[1]["loss"]


@pytest.mark.parametrize("name", sorted(COMPOSED))
def test_dp_shard_composes_with_recompute_and_activation_offload(results, name):
    singles, _, _, two = results
    single, got = singles[""], two[name]
    for step in range(1, 5):
        assert got[step]["loss"] == pytest.approx(single[step]["loss"], rel=1e-5, abs=0), (name, step)


def test_dp_shard_resume_is_bitwise(results):
    _, _, four, _ = results
    assert "resuming from" in four["resumed_log"]
    straight, resumed = four["dp4"], four["resumed"]
    for step in range(1, 5):
        assert resumed[step]["loss"] == straight[step]["loss"], step
        assert resumed[step]["grad_norm"] == straight[step]["grad_norm"], step


def test_checkpoints_move_between_zero3_and_zero1_at_any_dp_bitwise(results):
    _, _, four, two = results
    paths = [four["checkpoint"], two["zero1"], two["zero3"]]
    readers = [CheckpointReader(p) for p in paths]
    try:
        names = readers[0].tensor_names()
        assert all(r.tensor_names() == names for r in readers)
        assert [r.layout.to_dict() for r in readers] == [
            {"tp": 1, "pp": 1, "vpp": 1, "dp": 4},
            {"tp": 1, "pp": 1, "vpp": 1, "dp": 2},
            {"tp": 2, "pp": 1, "vpp": 1, "dp": 1},
        ]
        for name in names:
            first = readers[0].read_full(name)
            for other in readers[1:]:
                assert torch.equal(other.read_full(name), first), name
            for kind in ("master", "exp_avg", "exp_avg_sq"):
                key = f"{name}/{kind}"
                first = readers[0].read_full(name, kind="optim", key=key)
                assert first.abs().sum() > 0, key
                for other in readers[1:]:
                    assert torch.equal(other.read_full(name, kind="optim", key=key), first), key
        assert all(r.train_state["optimizer"]["step"] == 2 for r in readers)
    finally:
        for r in readers:
            r.close()


def test_dp_shard_bf16_trains_like_one_process_bf16(results):
    _, single_bf16, _, two = results
    got = two["bf16"]
    for step in range(1, 5):
        assert got[step]["loss"] == pytest.approx(single_bf16[step]["loss"], rel=2e-2), step
    assert two["bf16_sample"] and two["bf16_val_loss"] > 0


@pytest.mark.parametrize(
    "extra,match",
    [
        (["parallel.distributed_optimizer=true"], "drop parallel.distributed_optimizer"),
        (["parallel.pp=2", "parallel.schedule=zero-bubble"], "use 1f1b or interleaved"),
    ],
)
def test_config_refuses_dp_shard_with(extra, match):
    with pytest.raises(Exception, match=match):
        load_config(None, ["model=llama-tiny", SHARD, *extra])
