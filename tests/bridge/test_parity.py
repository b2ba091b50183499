"""Converted checkpoints load with mcore-train's loader at tp=1, tp=2, pp=2 and tp=2 x pp=2 and give the logits of
transformers (fp32, max abs <= 1e-4); ``load_hf_into`` fills a tp=2 x pp=2 stage directly; a training checkpoint
saved at tp=2 x pp=2 exports to HF with the same logits.

Four gloo ranks are spawned once; every layout and every family runs inside them.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from mcore.bridge.convert import convert
from tests.bridge.factory import LLAMA31_ROPE, save_tiny_hf
from tests.helpers.distributed import run_workers

WORLD = 4
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]  # (tp, pp); dp fills the rest of the 4 ranks
CASES = {
    "llama3.1-rope": ("llama", {"rope_parameters": {**LLAMA31_ROPE, "rope_theta": 500000.0}}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "qwen2-tied-sliding": (
        "qwen2",
        {"tie_word_embeddings": True, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
    ),
    "qwen3": ("qwen3", {}),
    "mistral": ("mistral", {}),
}
ATOL = 1e-4


def _ids() -> torch.Tensor:
    return torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(123))


def _config(model_config, tp: int, pp: int):
    from mcore.train.config import Config, ParallelSection, TrainSection

    train = TrainSection(device="cpu", precision="fp32", global_batch_size=4, micro_batch_size=1)
    return Config(model=model_config, parallel=ParallelSection(tp=tp, pp=pp), train=train)


def _pipeline_logits(chunk, ids: torch.Tensor) -> torch.Tensor | None:
    """Run this rank's stage; the last stage returns the full (TP-gathered, unpadded) logits, others None."""
    groups = chunk.groups
    with torch.no_grad():
        if groups.pp_rank == 0:
            hidden = chunk(ids)
        else:
            hidden = torch.empty(ids.shape[1], ids.shape[0], chunk.config.hidden_size)
            dist.recv(hidden, groups.pp_prev_rank)
            hidden = chunk(hidden_states=hidden)
        if groups.pp_rank < groups.pp_size - 1:
            dist.send(hidden.contiguous(), groups.pp_next_rank)
            return None
    logits = hidden.contiguous()
    if groups.tp_size > 1:
        parts = [torch.empty_like(logits) for _ in range(groups.tp_size)]
        dist.all_gather(parts, logits, group=groups.tp)
        logits = torch.cat(parts, dim=-1)
    return logits[..., : chunk.config.vocab_size]


def _stage_model(config, groups):
    """This rank's pipeline stage of ``config``, built directly (not through mcore-train)."""
    from mcore.models.gpt import GPTModel
    from mcore.parallel.pipeline import stage_layer_ranges

    layer_range = stage_layer_ranges(config.num_hidden_layers, groups.pp_size)[groups.pp_rank][0]
    first, last = groups.pp_rank == 0, groups.pp_rank == groups.pp_size - 1
    return GPTModel(config, groups=groups, layer_range=layer_range, pre_process=first, post_process=last).eval()


def _workers(rank: int, world_size: int, mcore_dirs: dict[str, str], hf_dirs: dict[str, str], train_dir: str) -> dict:
    from mcore.bridge.api import load_hf_into
    from mcore.train.checkpoint import CheckpointReader
    from mcore.train.checkpoint.directory import CheckpointDirectory
    from mcore.train.checkpoint.state import CheckpointSaver
    from mcore.train.runtime import init_runtime
    from mcore.train.trainer import Trainer

    ids = _ids()
    out: dict = {}
    readers = {case: CheckpointReader(path) for case, path in mcore_dirs.items()}
    for tp, pp in LAYOUTS:
        runtime = init_runtime(_config(next(iter(readers.values())).model_config, tp, pp))
        for case, reader in readers.items():
            trainer = Trainer(_config(reader.model_config, tp, pp), runtime, weights=reader, with_optimizer=False)
            logits = _pipeline_logits(trainer.chunks[0], ids)
            if logits is not None and runtime.groups.tp_rank == 0 and runtime.groups.dp_rank == 0:
                out[(case, tp, pp)] = logits.numpy()  # numpy: torch tensors would cross by fd passing
            if (tp, pp) == (2, 2):  # the Python API loads HF weights straight into a TP x PP stage
                model = _stage_model(reader.model_config, runtime.groups)
                load_hf_into(model, hf_dirs[case])
                logits = _pipeline_logits(model, ids)
                if logits is not None and runtime.groups.tp_rank == 0:
                    out[(case, "load_hf_into")] = logits.numpy()
    # A training checkpoint (optimizer state included) saved at tp=2 x pp=2 from a model of its own seed; tied
    # embeddings, so the last stage's copy of the embedding must not end up in the export twice.
    config = _config(readers["llama-tied"].model_config, 2, 2)
    trainer = Trainer(config, init_runtime(config), with_optimizer=True)
    logits = _pipeline_logits(trainer.chunks[0], ids)
    if logits is not None and trainer.groups.tp_rank == 0:
        out["trained"] = logits.numpy()
    CheckpointSaver(trainer, CheckpointDirectory(train_dir), keep_last=1, async_save=False).save(train_config=None)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("parity")
    mcore_dirs, hf_dirs, expected = {}, {}, {}
    for case, (family, overrides) in CASES.items():
        hf = save_tiny_hf(root / f"{case}-hf", family, seed=21, **overrides)
        convert(hf, root / f"{case}-mcore", progress=False)
        mcore_dirs[case], hf_dirs[case] = str(root / f"{case}-mcore"), str(hf)
        with torch.no_grad():
            expected[case] = AutoModelForCausalLM.from_pretrained(hf, attn_implementation="eager")(_ids()).logits
    results = run_workers(WORLD, _workers, mcore_dirs, hf_dirs, str(root / "train" / "checkpoints"))
    merged = {k: torch.from_numpy(v) for r in results for k, v in r.items()}
    return root, expected, merged


@pytest.mark.parametrize("tp,pp", LAYOUTS)
@pytest.mark.parametrize("case", list(CASES))
def test_converted_checkpoint_matches_transformers_at_any_layout(runs, case, tp, pp):
    _, expected, got = runs
    diff = (got[(case, tp, pp)] - expected[case]).abs().max().item()
    assert diff <= ATOL, f"{case} at tp={tp} pp={pp}: max |logit diff| {diff:.3e}"


@pytest.mark.parametrize("case", list(CASES))
def test_load_hf_into_a_tp2_pp2_stage_matches_transformers(runs, case):
    _, expected, got = runs
    diff = (got[(case, "load_hf_into")] - expected[case]).abs().max().item()
    assert diff <= ATOL, f"{case}: max |logit diff| {diff:.3e}"


def test_training_checkpoint_at_tp2_pp2_exports_to_transformers(runs):
    root, _, got = runs
    run_dir = root / "train"
    assert (run_dir / "checkpoints" / "latest").is_file()
    assert any((run_dir / "checkpoints").glob("iter_*/optim/tp01-pp01.safetensors")), "not a training checkpoint"
    result = convert(run_dir, root / "trained-hf", progress=False)
    assert result.direction == "mcore->hf"
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(root / "trained-hf", attn_implementation="eager")(_ids()).logits
    diff = (logits - got["trained"]).abs().max().item()
    assert diff <= ATOL, f"max |logit diff| {diff:.3e}"
