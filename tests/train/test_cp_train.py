"""``parallel.cp`` through mcore-train's real loop (``run_training``: data, Trainer step, DDP, optimizer, checkpoints).

One 4-rank gloo spawn runs every layout; each run's per-step loss and gradient norm over 4 AdamW steps equal the
single-process run's within 1e-5 (fp32, CPU), and two runs' final weights equal the single-process weights:

- cp2 (x dp2) with each ``cp_comm_type`` (p2p, all_gather, a2a), without and with packed documents (mock data: 1 to 15
  tokens per document, so odd lengths are padded per document to a multiple of 2 x cp) and a sliding window;
- cp4 (p2p, packed and not) and a2a+p2p as 2 x 2 (packed with a window, and not);
- an MoE model (mixtral-tiny) at cp2; Mamba-2 hybrids (nemotron_h-tiny packed, falcon_h1-tiny) at cp2; cp2 x tp2
  with sequence parallelism; cp2 x pp2 (1F1B: fixed activation shapes unpacked, exchanged shapes packed) and
  cp2 x pp2 x vpp2 (interleaved) with full recompute; cp2 x dp2 with the distributed optimizer, and with
  ``dp_shard`` (FSDP2 over the dp x cp ranks);
- dynamic CP (``parallel.cp_dynamic``) over the 4 ranks at cp2 x dp2 and cp4: each document placed by its length,
  the losses of static CP;
- checkpoints: a run stopped at step 2 at cp2 x dp2 resumes at cp1 x dp4, and one stopped at cp1 x dp4 resumes at
  cp4: both give the straight single-process curve.

``optim.eps=1e-6`` (instead of 1e-8): AdamW's first steps move every weight by about ``lr x sign(grad)``, so
gradient entries that are zero up to rounding (~1e-10, different in every summation order) would move by a whole
learning rate in a random direction and the curves would part by rounding alone; the larger eps keeps those
entries still and leaves the others' updates as they were.
"""

from __future__ import annotations

import pytest

from mcore.train.checkpoint import CheckpointReader
from mcore.train.config import load_config
from tests.helpers.distributed import run_workers
from tests.train.tiny import TINY, train, train_records

REL = 1e-5
STEPS = [
    "train.steps=4",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "checkpoint.save_at_end=false",
    "optim.eps=1e-6",
    "train.eval_interval=4",  # one evaluation, at the end: its loss is compared too
    "train.eval_steps=1",
]
PACKED = ["data.mock=true", "data.packing=true"]
WINDOW = ["model.sliding_window=6"]
# the embedded corpus packed into 64-token rows: documents of 1 to 64 tokens, so dynamic CP places some whole on
# one rank and the others over 2 (at most seq_length / cp = 32 tokens per rank)
PACKED64 = ["data.packing=true", "data.seq_length=64"]
REFERENCES = {
    "plain": [],
    "window": WINDOW,
    "packed": PACKED,
    "packed_window": PACKED + WINDOW,
    "packed64": PACKED64,
    "moe": ["model=mixtral-tiny"],
    "packed_4layers": [*PACKED, "model.num_hidden_layers=4"],
    "nemotron_h_packed": ["model=nemotron_h-tiny", *PACKED],
    "falcon_h1": ["model=falcon_h1-tiny"],
}
CP2, CP4 = ["parallel.cp=2"], ["parallel.cp=4"]
# name: (single-process reference, overrides of the 4-rank run)
CASES = {
    "cp2_p2p": ("plain", [*CP2, "train.sample_tokens=4"]),  # and the end-of-run sample (generation without CP)
    "cp2_p2p_packed": ("packed", CP2),
    "cp2_p2p_packed_window": ("packed_window", CP2),
    "cp2_all_gather": ("window", [*CP2, "parallel.cp_comm_type=all_gather"]),
    "cp2_all_gather_packed_window": ("packed_window", [*CP2, "parallel.cp_comm_type=all_gather"]),
    "cp2_a2a": ("plain", [*CP2, "parallel.cp_comm_type=a2a"]),
    "cp2_a2a_packed_window": ("packed_window", [*CP2, "parallel.cp_comm_type=a2a"]),
    "cp4_p2p": ("window", CP4),
    "cp4_p2p_packed": ("packed", CP4),
    "cp4_a2a+p2p_2x2": ("plain", [*CP4, "parallel.cp_comm_type=a2a+p2p", "parallel.cp_a2a_size=2"]),
    "cp4_a2a+p2p_2x2_packed_window": (
        "packed_window",
        [*CP4, "parallel.cp_comm_type=a2a+p2p", "parallel.cp_a2a_size=2"],
    ),
    "cp2_tp2_sp_packed": ("packed", [*CP2, "parallel.tp=2", "parallel.sequence_parallel=true"]),
    "cp2_pp2": ("plain", [*CP2, "parallel.pp=2"]),
    "cp2_pp2_packed": ("packed", [*CP2, "parallel.pp=2"]),
    "cp2_pp2_vpp2_recompute_full_packed": (
        "packed_4layers",
        [*CP2, "parallel.pp=2", "parallel.vpp=2", "train.recompute=full"],
    ),
    "cp2_dp2_distopt_packed": ("packed", [*CP2, "parallel.distributed_optimizer=true"]),
    "cp2_dp2_dp_shard_packed": ("packed", [*CP2, "parallel.dp_shard=true"]),  # FSDP2 over dp x cp
    "cp2_p2p_packed64": ("packed64", CP2),
    "cp2_moe": ("moe", CP2),  # mixtral-tiny: no aux loss
    "cp2_nemotron_h_packed": ("nemotron_h_packed", CP2),  # Mamba-2 layers: the all-to-all around the scan
    "cp2_falcon_h1": ("falcon_h1", CP2),
    "cp2_dynamic_packed64": ("packed64", [*CP2, "parallel.cp_dynamic=true"]),
    "cp4_dynamic_packed64": ("packed64", [*CP4, "parallel.cp_dynamic=true"]),
}
SAVED = ("cp2_tp2_sp_packed", "cp2_dp2_distopt_packed")  # final weights compared too
RESUMES = {"cp2_to_cp1": (CP2, []), "cp1_to_cp4": ([], CP4)}  # (first two steps, last two steps)


def _run(base, name, *extra):
    save = ["checkpoint.save_at_end=true"] if name in SAVED or name.startswith("packed") else []
    result, log = train(base / name, *STEPS, *extra, *save)
    return result, log


def _four_rank_cases(rank: int, world_size: int, base):
    out = {}
    for name, (_, extra) in CASES.items():
        result, log = _run(base, name, *REFERENCES[CASES[name][0]], *extra)
        out[name] = train_records(base / name) if rank == 0 else None
        out[f"{name}/log"], out[f"{name}/val"], out[f"{name}/sample"] = log, result.val_loss, result.sample
    out["dynamic_sizes"] = _dynamic_group_sizes()
    for name, (first, second) in RESUMES.items():
        train(base / name, *STEPS, *first, "train.stop_at_step=2")
        _, log = train(base / name, *STEPS, *second)
        out[name] = train_records(base / name) if rank == 0 else None
        out[f"{name}/log"] = log
    return out


def _dynamic_group_sizes() -> list[int]:
    """The CP size dynamic CP gives each document of the first global batch of ``cp2_dynamic_packed64``."""
    from mcore.train.datasets import build_run_data, microbatch_stream
    from mcore.train.runtime import init_runtime
    from mcore.train.trainer import Trainer

    config = load_config(None, [*TINY, *STEPS, *PACKED64, *CP2, "parallel.cp_dynamic=true"])
    runtime = init_runtime(config)
    trainer = Trainer(config, runtime)
    g = runtime.groups
    stream = microbatch_stream(
        build_run_data(config).train, config, consumed_samples=0, dp_rank=g.dp_rank, dp_size=g.dp_size
    )
    trainer.train_step([next(stream) for _ in range(trainer.num_microbatches)])
    return [size for _, size in trainer.dynamic_cp.last_placement.groups]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    base = tmp_path_factory.mktemp("cp_train")
    singles = {}
    for name, extra in REFERENCES.items():
        result, _ = _run(base, name, *extra)
        singles[name] = train_records(base / name)
        singles[f"{name}/val"] = result.val_loss
    return base, singles, run_workers(4, _four_rank_cases, base)[0]


def _assert_same_curve(got, want, name):
    assert sorted(got) == sorted(want) == [1, 2, 3, 4], name
    for step in want:
        for key in ("loss", "grad_norm"):
            assert got[step][key] == pytest.approx(want[step][key], rel=REL, abs=0), (name, step, key)


@pytest.mark.parametrize("name", list(CASES))
def test_cp_run_equals_the_single_process_run(results, name):
    _, singles, four = results
    reference = CASES[name][0]
    _assert_same_curve(four[name], singles[reference], name)
    assert four[f"{name}/val"] == pytest.approx(singles[f"{reference}/val"], rel=REL, abs=0), name
    assert f"x cp {2 if 'cp2' in name else 4} x" in four[f"{name}/log"]
    if name == "cp2_p2p":
        assert four[f"{name}/sample"]


def test_dynamic_cp_places_documents_by_length_and_equals_static_cp(results):
    _, _, four = results
    sizes = four["dynamic_sizes"]
    assert 1 in sizes and 2 in sizes, sizes  # short documents whole on one rank, long ones over two
    static, dynamic = four["cp2_p2p_packed64"], four["cp2_dynamic_packed64"]
    for step in static:
        assert dynamic[step]["loss"] == pytest.approx(static[step]["loss"], rel=REL, abs=0), step


@pytest.mark.parametrize("name", SAVED)
def test_cp_final_weights_equal_the_single_process_weights(results, name):
    base, _, _ = results
    want = CheckpointReader(base / "packed" / "checkpoints" / "iter_0000004")
    got = CheckpointReader(base / name / "checkpoints" / "iter_0000004")
    try:
        names = want.tensor_names()
        assert got.tensor_names() == names and len(names) > 5
        for tensor in names:
            a, b = got.read_full(tensor).double(), want.read_full(tensor).double()
            assert (a - b).norm() <= REL * b.norm(), tensor
    finally:
        want.close()
        got.close()


@pytest.mark.parametrize("name", list(RESUMES))
def test_checkpoint_moves_between_cp_sizes(results, name):
    _, singles, four = results
    assert "resuming from" in four[f"{name}/log"]
    _assert_same_curve(four[name], singles["plain"], name)


# ---------------------------------------------------------------------------------------------- config
def _config(*extra):
    return load_config(None, [*TINY, *extra])


def test_cp_keys_and_world_size():
    config = _config("parallel.cp=2", "parallel.tp=2", "parallel.dp=2", "parallel.cp_comm_type=all_gather")
    assert config.parallel.cp == 2 and config.parallel.cp_comm_type == "all_gather"
    assert config.parallel.world_size() == 8
    assert _config("parallel.cp=4", "parallel.cp_comm_type=a2a+p2p", "parallel.cp_a2a_size=2").parallel.cp_a2a_size == 2


@pytest.mark.parametrize(
    "extra,match",
    [
        (["parallel.cp=3"], r"data.seq_length \(32\) must be a multiple of 2 x parallel.cp = 6.*use e.g. 36"),
        (
            [
                "parallel.cp=2",
                "parallel.tp=4",
                "parallel.sequence_parallel=true",
                "model.num_key_value_heads=4",
                "data.seq_length=36",
            ],
            r"data.seq_length \(36\) must be a multiple of lcm\(2 x cp, cp x tp\) = 8",
        ),
        (["parallel.cp=4", "parallel.cp_comm_type=a2a"], r"model.num_key_value_heads=2 / parallel.tp=1 = 2 .*by 4"),
        (["parallel.cp=2", "parallel.tp=2", "parallel.cp_comm_type=a2a"], "use cp_comm_type p2p or all_gather"),
        (["parallel.cp=4", "parallel.cp_comm_type=a2a+p2p"], r"needs parallel.cp_a2a_size.*one of \[2\]"),
        (["parallel.cp=4", "parallel.cp_comm_type=a2a+p2p", "parallel.cp_a2a_size=4"], r"\(one of \[2\]\); got 4"),
        (["parallel.cp=2", "parallel.cp_comm_type=a2a+p2p", "parallel.cp_a2a_size=2"], "cp must have a divisor"),
        (["parallel.cp=2", "parallel.cp_a2a_size=2"], "parallel.cp_a2a_size=2 is the a2a group size"),
        (["parallel.cp=2", "parallel.cp_comm_type=ring"], "cp_comm_type"),
        (["parallel.cp=0"], "parallel.cp must be > 0"),
        (["model=mamba2-tiny", "parallel.cp=4"], r"model.n_groups=2 / parallel.tp=1 = 2 groups .* by 4"),
        (["model=nemotron_h-tiny", "parallel.cp=2", "parallel.cp_dynamic=true"], "does not run Mamba-2 layers"),
        (["parallel.cp_dynamic=true"], r"cp_dynamic=true needs parallel.cp > 1"),
        (["parallel.cp=2", "parallel.tp=2", "parallel.cp_dynamic=true"], r"needs tp = pp = 1 \(got tp=2, pp=1\)"),
        (["parallel.cp=2", "parallel.cp_comm_type=a2a", "parallel.cp_dynamic=true"], "cp_comm_type=p2p"),
        (["parallel.cp=2", "parallel.dp_shard=true", "parallel.cp_dynamic=true"], "no dp_shard"),
        (
            ["model=mixtral-tiny", "model.router_aux_loss_coef=0.01", "parallel.cp=2", "parallel.cp_dynamic=true"],
            "runs MoE models only without aux losses",
        ),
        (
            ["model=mixtral-tiny", "parallel.cp=2", "parallel.ep=2", "parallel.cp_dynamic=true"],
            "and with parallel.ep=1",
        ),
    ],
)
def test_bad_cp_layouts_are_refused_naming_the_key(extra, match):
    with pytest.raises(Exception, match=match):
        _config(*extra)


def test_seq_length_131072_is_accepted():
    config = _config("model=llama3.1-8b", "data.seq_length=131072", "parallel.cp=8", "parallel.tp=2")
    assert config.data.seq_length == 131072


def test_layout_is_refused_when_the_world_does_not_divide():
    from mcore.parallel.grid import ParallelConfig

    with pytest.raises(ValueError, match="not divisible by tp\\*pp\\*cp = 4"):
        ParallelConfig(tp=2, cp=2).resolve(6)


def test_sinks_and_mla_run_under_cp_and_mtp_is_refused_with_dynamic_cp():
    # sinks, MLA and MTP under CP: tests/train/test_cp_sinks_mtp.py
    assert _config("model=gpt_oss-tiny", "parallel.cp=2").parallel.cp == 2
    assert _config("model=deepseek_v3-tiny", "model.num_nextn_predict_layers=1", "parallel.cp=2").parallel.cp == 2
    with pytest.raises(Exception, match=r"cp_dynamic=true does not run multi-token prediction"):
        _config("model.num_nextn_predict_layers=1", "parallel.cp=2", "parallel.cp_dynamic=true")
