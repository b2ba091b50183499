"""Resume: stopping and resuming gives the losses of the uninterrupted run, at the same or another layout.

- tp=1 (one process) and tp=2 x pp=2 with tied embeddings (four gloo ranks): 12 steps straight vs 6 + stop +
  resume to 12, bitwise equal losses and gradient norms step by step (fp32 on CPU);
- saved at tp=2 x pp=2, resumed at tp=1 x pp=1 x dp=2: losses equal within 1e-5 of the straight run;
- pp=2 with the uneven ``parallel.pipeline_layout=[2,0]``: the losses of the even tp=2 x pp=2 run within 1e-5;
- a model-only checkpoint streamed through ModelCheckpointWriter loads at tp=2 and gives the logits of the
  single-process model it came from.
"""

from __future__ import annotations

import pytest
import torch

from mcore.models.families import get_config
from mcore.models.gpt import GPTModel
from mcore.train.checkpoint import CheckpointReader, ModelCheckpointWriter
from tests.helpers.distributed import run_workers
from tests.train.tiny import train, train_records

# Tied embeddings: under pp=2 the last stage holds a copy of embedding.weight that is saved once, loaded twice.
TIED = "model.tie_word_embeddings=true"
LAYOUT_4 = ["parallel.tp=2", "parallel.pp=2", TIED]


def _straight_and_resumed(base, extra):
    straight, resumed = base / "straight", base / "resumed"
    train(straight, *extra)
    first, _ = train(resumed, *extra, "train.stop_at_step=6")
    second, log = train(resumed, *extra)
    return straight, resumed, first, second, log


def _four_rank_cases(rank: int, world_size: int, base):
    straight, resumed, first, second, log = _straight_and_resumed(base, LAYOUT_4)
    if rank != 0:
        return None
    return {
        "straight": train_records(straight),
        "resumed": train_records(resumed),
        "first_status": first.status,
        "second_iteration": second.iteration,
        "log": log,
        "checkpoint_6": str(resumed / "checkpoints" / "iter_0000006"),
    }


def _two_rank_cases(rank: int, world_size: int, base, checkpoint_6, model_only):
    out = {}
    # saved at tp=2 pp=2 (dp=1), resumed at tp=1 pp=1 dp=2
    result, log = train(base / "relayout", TIED, f"checkpoint.load={checkpoint_6}")
    if rank == 0:
        out["relayout"] = train_records(base / "relayout")
        out["relayout_log"] = log
        out["relayout_iteration"] = result.iteration
    # pp=2 with an uneven layout (every layer on the first stage, the output layer alone on the last): the losses
    # of the tp=2 x pp=2 run with its even split
    _, uneven_log = train(base / "uneven", TIED, "parallel.pp=2", "parallel.pipeline_layout=[2,0]")
    if rank == 0:
        out["uneven"] = train_records(base / "uneven")
        out["uneven_log"] = uneven_log
    # a model-only checkpoint loaded at tp=2: logits equal to the model it was written from
    from mcore.train.config import load_config
    from mcore.train.runtime import init_runtime
    from mcore.train.trainer import Trainer

    config = load_config(None, ["model=llama-tiny", "parallel.tp=2", "data.seq_length=32"])
    runtime = init_runtime(config)
    with CheckpointReader(model_only) as reader:
        trainer = Trainer(config, runtime, weights=reader, with_optimizer=False)
    ids = torch.arange(2 * 16).view(2, 16) * 7 % 320
    local = trainer.chunks[0](ids).detach()  # [b, s, V_pad / tp]
    gathered = [torch.empty_like(local) for _ in range(2)]
    torch.distributed.all_gather(gathered, local.contiguous(), group=runtime.groups.tp)
    # numpy pickles by value; a tensor would travel as shared memory that dies with this process
    out["logits"] = torch.cat(gathered, dim=-1)[..., :320].numpy()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    base = tmp_path_factory.mktemp("resume")
    four = run_workers(4, _four_rank_cases, base)[0]
    # The model-only checkpoint: full tensors of a single-process model, streamed in reverse order.
    model_config = get_config("llama-tiny")
    reference = GPTModel(model_config)
    reference.init_weights(4321)
    model_only = base / "model-only"
    with ModelCheckpointWriter(model_only, model_config) as writer:
        for name, param in reversed(list(reference.named_parameters())):
            rows = getattr(param, "vocab_size", None)
            writer.add(name, param.detach()[:rows] if getattr(param, "vocab_padded_dim", None) == 0 else param)
    ids = torch.arange(2 * 16).view(2, 16) * 7 % 320
    with torch.no_grad():
        expected_logits = reference(ids)[..., :320]
    two = run_workers(2, _two_rank_cases, base, four["checkpoint_6"], model_only)[0]
    return four, two, expected_logits


def _assert_bitwise(straight: dict, resumed: dict) -> None:
    assert sorted(straight) == sorted(resumed) == list(range(1, 13))
    for step in range(1, 13):
        assert resumed[step]["loss"] == straight[step]["loss"], step
        assert resumed[step]["grad_norm"] == straight[step]["grad_norm"], step
        assert resumed[step]["lr"] == straight[step]["lr"], step


@pytest.mark.parametrize("precision", ["fp32", "fp16"])  # fp16: the loss scaler's state resumes too
def test_resume_single_process_is_bitwise_identical(tmp_path, precision):
    straight, resumed, first, second, log = _straight_and_resumed(tmp_path, [f"train.precision={precision}"])
    assert first.status == "stopped" and first.iteration == 6
    assert "resuming from" in log and second.iteration == 12
    _assert_bitwise(train_records(straight), train_records(resumed))
    losses = [train_records(straight)[s]["loss"] for s in (1, 12)]
    assert losses[1] < losses[0]


def test_resume_tp2_pp2_is_bitwise_identical(results):
    four, _, _ = results
    assert four["first_status"] == "stopped" and four["second_iteration"] == 12
    assert "resuming from" in four["log"]
    _assert_bitwise(four["straight"], four["resumed"])


def test_resume_into_another_layout(results):
    four, two, _ = results
    assert two["relayout_iteration"] == 12
    assert "layout" in two["relayout_log"] and "resharded" in two["relayout_log"]
    relayout = two["relayout"]
    assert sorted(relayout) == list(range(7, 13))
    for step in range(7, 13):
        assert relayout[step]["loss"] == pytest.approx(four["straight"][step]["loss"], abs=1e-5, rel=0), step


def test_uneven_pipeline_layout_trains_like_the_even_one(results):
    four, two, _ = results
    uneven = two["uneven"]
    assert "pipeline layout (given): layers per virtual stage [2, 0]" in two["uneven_log"]
    assert sorted(uneven) == list(range(1, 13))
    for step in range(1, 13):
        assert uneven[step]["loss"] == pytest.approx(four["straight"][step]["loss"], abs=1e-5, rel=0), step


def test_model_only_checkpoint_loads_at_tp2(results):
    _, two, expected = results
    torch.testing.assert_close(torch.from_numpy(two["logits"]), expected, rtol=1e-5, atol=1e-5)
