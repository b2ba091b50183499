"""Checkpoints of expert-parallel runs (2 gloo ranks): saved with every expert whatever the ep, so that ep=2 ->
ep=1 -> ep=2 round-trips bit-exactly (weights and optimizer states), the ep=2 file holds the experts of both ep
ranks (it equals an ep=1 run's within the ep1-vs-ep2 training tolerance), and a run resumed at another ep goes on
with the same losses."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.distributed import run_workers
from tests.train.test_moe_train import MOE

COMMON = [*MOE, "train.steps=3", "parallel.distributed_optimizer=true"]


def _resave(config_overrides: list[str], load: str, dst: str) -> None:
    """Build the trainer of ``config_overrides`` from checkpoint ``load`` and save it again into ``dst``, no step."""
    from mcore.train.checkpoint.directory import CheckpointDirectory
    from mcore.train.checkpoint.state import CheckpointSaver
    from mcore.train.config import config_to_dict, load_config
    from mcore.train.runtime import init_runtime
    from mcore.train.start import build_trainer
    from tests.train.tiny import TINY

    config = load_config(None, [*TINY, *config_overrides, f"log.run_dir={dst}-run"])
    runtime = init_runtime(config)
    trainer = build_trainer(config, runtime, load=load).trainer
    saver = CheckpointSaver(trainer, CheckpointDirectory(dst), keep_last=1, async_save=False)
    saver.save(config_to_dict(config), {})


def _roundtrip(rank: int, world: int, root: str) -> dict:
    from tests.train.tiny import train, train_records

    for ep in (1, 2):
        train(f"{root}/ep{ep}", *COMMON, f"parallel.ep={ep}", "checkpoint.save_at_end=true")
    # expert TP over both ranks while tp = 1: the FFN slices are gathered over etp at save
    train(f"{root}/etp2", *COMMON, "parallel.etp=2", "checkpoint.save_at_end=true")
    saved = f"{root}/ep2/checkpoints/latest"
    _resave([*COMMON, "parallel.ep=1"], saved, f"{root}/as_ep1")
    _resave([*COMMON, "parallel.ep=2"], f"{root}/as_ep1/latest", f"{root}/as_ep2")
    _resave([*COMMON, "parallel.etp=2"], f"{root}/as_ep1/latest", f"{root}/as_etp2")
    _resave([*COMMON, "parallel.ep=2"], f"{root}/etp2/checkpoints/latest", f"{root}/etp2_as_ep2")
    # resume the ep=2 checkpoint at ep=1 and at ep=2 for two more steps
    losses = {}
    for ep in (1, 2):
        run_dir = f"{root}/resume{ep}"
        train(run_dir, *COMMON, "train.steps=5", f"parallel.ep={ep}", f"checkpoint.load={saved}")
        losses[ep] = [r["loss"] for _, r in sorted(train_records(run_dir).items())]
    return losses


def _tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    if checkpoint.name == "latest":  # a file naming the checkpoint
        checkpoint = checkpoint.parent / checkpoint.read_text().strip()
    out = {}
    for kind in ("model", "optim"):
        for f in sorted((checkpoint / kind).glob("*.safetensors")):
            out.update({f"{kind}:{f.name}:{k}": v for k, v in load_file(str(f)).items()})
    return out


@pytest.fixture(scope="module")
def roundtrip(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_ckpt")
    losses = run_workers(2, _roundtrip, str(root))[0]
    return root, losses


def test_ep2_to_ep1_and_back_is_bit_exact(roundtrip):
    root, _ = roundtrip
    saved = _tensors(root / "ep2" / "checkpoints" / "latest")
    experts = [k for k in saved if k.endswith("experts.gate_up") or "experts.gate_up/" in k]
    assert experts and all(saved[k].shape[0] == 4 for k in experts)  # all 4 experts of mixtral-tiny
    for again in ("as_ep1", "as_ep2", "as_etp2"):
        other = _tensors(root / again / "latest")
        assert sorted(other) == sorted(saved)
        for key, tensor in saved.items():
            assert torch.equal(other[key], tensor), (again, key)


def test_ep2_checkpoint_holds_both_ranks_experts(roundtrip):
    root, _ = roundtrip
    ep2 = _tensors(root / "ep2" / "checkpoints" / "latest")
    ep1 = _tensors(root / "ep1" / "checkpoints" / "latest")
    assert sorted(ep1) == sorted(ep2)
    for key in ep1:
        if key.startswith("model:"):  # the same training at ep=1 and ep=2: equal up to fp32 reduction order
            torch.testing.assert_close(ep2[key], ep1[key], rtol=1e-4, atol=1e-5, msg=key)


def test_resume_at_another_ep_continues_the_same(roundtrip):
    _, losses = roundtrip
    assert len(losses[1]) == len(losses[2]) == 2  # steps 4 and 5
    for a, b in zip(losses[1], losses[2]):
        assert abs(a - b) <= 1e-5 * abs(b), losses


def test_etp_checkpoint_is_unsplit_and_loads_at_ep(roundtrip):
    root, _ = roundtrip
    etp2 = _tensors(root / "etp2" / "checkpoints" / "latest")
    ep1 = _tensors(root / "ep1" / "checkpoints" / "latest")
    assert sorted(etp2) == sorted(ep1)  # the FFN gathered over etp: one file, the ep=1 run's shapes
    for key in ep1:
        if key.startswith("model:"):
            torch.testing.assert_close(etp2[key], ep1[key], rtol=1e-4, atol=1e-5, msg=key)
    again = _tensors(root / "etp2_as_ep2" / "latest")  # loaded at ep=2 (etp 1), saved again: the same
    for key, tensor in etp2.items():
        assert torch.equal(again[key], tensor), key
