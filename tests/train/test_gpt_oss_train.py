"""mcore-train with GPT-OSS (sinks, sliding/full layers, YaRN, router bias, biased experts with the clamped SwiGLU):
tp2 (experts at etp2), ep2, pp2, tp2 x ep2 and FSDP2 with per-expert GEMMs on 4 gloo ranks give the losses and
gradient norms of one process
within 1e-5 over 4 optimizer steps, and so do checkpoints saved at tp2 and at ep2 and resumed in one process; the
example configs load and plan."""

from __future__ import annotations

from pathlib import Path

import pytest

from mcore.train.config import load_config
from mcore.train.plan import make_plan
from tests.helpers.distributed import run_workers

# 4 layers (pp2 gets two per stage), sequences of 32 > the tiny preset's window of 8; a clamp the tiny model's
# pre-activations cross, so that the clamped SwiGLU's branches matter
GPT_OSS = [
    "model=gpt_oss-tiny",
    "model.num_hidden_layers=4",
    "model.layer_types=[sliding_attention, full_attention, sliding_attention, full_attention]",
    "model.swiglu_limit=0.1",
    "train.steps=4",
    "train.global_batch_size=8",
    "checkpoint.save_at_end=false",
]
LAYOUTS = {
    "dp4": [],
    "tp2": ["parallel.tp=2"],
    "ep2": ["parallel.ep=2"],
    "pp2": ["parallel.pp=2"],
    "tp2-ep2": ["parallel.tp=2", "parallel.ep=2"],
    # FSDP2 (ZeRO-3) with one GEMM per expert: the biased experts' weight gradients through FSDP's reduce-scatter
    "dp4-shard-per-expert": [
        "parallel.dp_shard=true",
        "model.moe_router={softmax_before_topk: false, expert_gemm: per_expert}",
    ],
}


def _curve(run_dir: str) -> list[tuple[float, float]]:
    from tests.train.tiny import train_records

    return [(r["loss"], r["grad_norm"]) for _, r in sorted(train_records(run_dir).items())]


def _layout_curves(rank: int, world: int, run_root: str) -> dict:
    from tests.train.tiny import train

    out = {}
    for name, overrides in LAYOUTS.items():
        train(f"{run_root}/{name}", *GPT_OSS, *overrides)
        out[name] = _curve(f"{run_root}/{name}")
    # checkpoints saved after 2 steps at tp2 (sinks, router and expert biases split or replicated over tp / etp) and
    # at ep2 (expert biases gathered over ep)
    for name, layout in (("tp2", "parallel.tp=2"), ("ep2", "parallel.ep=2")):
        train(f"{run_root}/{name}-saved", *GPT_OSS, layout, "train.stop_at_step=2", "checkpoint.save_at_end=true")
    return out


def test_parallel_layouts_equal_one_process(tmp_path):
    from tests.train.tiny import train

    train(tmp_path / "single", *GPT_OSS)  # one process: 4 micro-batches of 2 per step
    reference = _curve(str(tmp_path / "single"))
    assert len(reference) == 4 and reference[-1][0] < reference[0][0]
    curves = run_workers(4, _layout_curves, str(tmp_path))[0]
    # each checkpoint resumed in one process continues the single-process run
    for name in ("tp2", "ep2"):
        saved = tmp_path / f"{name}-saved" / "checkpoints" / "iter_0000002"
        train(tmp_path / f"{name}-resumed", *GPT_OSS, f"checkpoint.load={saved}")
        curves[f"{name}-saved-then-one-process"] = reference[:2] + _curve(str(tmp_path / f"{name}-resumed"))
    for name, got in curves.items():
        assert len(got) == 4, name
        for (loss, norm), (ref_loss, ref_norm) in zip(got, reference):
            assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (name, got, reference)
            assert abs(norm - ref_norm) <= 1e-5 * abs(ref_norm), (name, got, reference)


EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("name,experts,world_size", [("gpt-oss-20b.yaml", 32, 8), ("gpt-oss-120b.yaml", 128, 32)])
def test_gpt_oss_examples_load_and_fit_their_gpus(name, experts, world_size):
    config = load_config(EXAMPLES / name)
    assert config.model.model_type == "gpt_oss" and config.model.num_experts == experts
    assert config.model.attention_sinks and config.model.swiglu_limit == 7.0
    assert make_plan(config, world_size, gpu_memory_gb=141.0).fits


def test_gpt_oss_120b_on_one_node_fits_only_with_the_optimizer_offloaded():
    config = load_config(EXAMPLES / "gpt-oss-120b.yaml", ["parallel.tp=8", "parallel.pp=1"])
    assert not make_plan(config, 8, gpu_memory_gb=141.0).fits
    one_node = ["parallel.tp=8", "parallel.pp=1", "train.recompute=full", "optim.offload_fraction=1"]
    offloaded = load_config(EXAMPLES / "gpt-oss-120b.yaml", one_node)
    assert make_plan(offloaded, 8, gpu_memory_gb=141.0).fits


def test_context_parallel_takes_the_sinks():
    from tests.train.tiny import TINY

    # sinks under CP: tests/train/test_cp_sinks_mtp.py
    config = load_config(None, [*TINY, "model=gpt_oss-tiny", "parallel.cp=2", "train.global_batch_size=2"])
    assert config.model.attention_sinks and config.parallel.cp == 2
