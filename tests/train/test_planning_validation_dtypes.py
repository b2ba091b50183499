"""The validation cases read the precision-aware optimizer's dtypes (``optim.main_grads_dtype`` / ``exp_avg_dtype``
/ ``exp_avg_sq_dtype``) from a record's overrides, for the hybrid (Nemotron-H) runs as for the MoE ones: a synthetic
bf16 record, a copy of the measured Nemotron-H ZeRO-1 record with those overrides added, gets the bf16 plan (less
gradient and optimizer memory, a shorter optimizer step) and the untouched record keeps fp32."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mcore.train.planning.cluster import PRESETS, Network
from mcore.train.planning.memory import stage_memory
from mcore.train.planning.step import predict_step
from mcore.train.planning.validation import ssm_cases

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
SSM_RECORD = RESULTS / "helpers-h200-2026-12-01-s3" / "ssm" / "mcore_nemotronh8b4l_zero1.json"
DTYPE_KEYS = ("main_grads_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")
H200 = Network(PRESETS["h200-node"])


def _synthetic_results(tmp_path: Path, extra: list[str]) -> Path:
    """A results tree with the measured record and a copy of it whose overrides add ``extra``."""
    ssm = tmp_path / "helpers-h200-synthetic" / "ssm"
    ssm.mkdir(parents=True)
    shutil.copy(SSM_RECORD, ssm / SSM_RECORD.name)
    record = json.loads(SSM_RECORD.read_text())
    record["config"] = "zero1_bf16_optim"
    record["overrides"] = [*record["overrides"], *extra]
    (ssm / "mcore_nemotronh8b4l_zero1_bf16_optim.json").write_text(json.dumps(record))
    return tmp_path


def test_ssm_cases_read_the_optimizer_dtypes_of_the_overrides(tmp_path):
    bf16 = [f"optim.{k}=bf16" for k in DTYPE_KEYS]
    cases = {c.name.split(" (")[0]: c for c in ssm_cases(_synthetic_results(tmp_path, bf16))}
    plain, ours = cases["nemotron-h-8b-4l zero1"], cases["nemotron-h-8b-4l zero1_bf16_optim"]
    assert [getattr(plain.layout, k) for k in DTYPE_KEYS] == ["fp32"] * 3
    assert [getattr(ours.layout, k) for k in DTYPE_KEYS] == ["bf16"] * 3
    assert ours.layout.replace(**dict.fromkeys(DTYPE_KEYS, "fp32")) == plain.layout  # nothing else differs
    mem_plain, mem_ours = stage_memory(plain.shape, plain.layout)[0], stage_memory(ours.shape, ours.layout)[0]
    assert mem_ours.allocated < mem_plain.allocated
    step_plain = predict_step(plain.shape, plain.layout, H200).breakdown["optimizer"]
    assert predict_step(ours.shape, ours.layout, H200).breakdown["optimizer"] < step_plain


def test_the_last_override_of_a_key_wins_and_only_exp_avg_sq_may_change(tmp_path):
    extra = ["optim.exp_avg_sq_dtype=fp32", "optim.exp_avg_sq_dtype=bf16"]
    cases = {c.name.split(" (")[0]: c for c in ssm_cases(_synthetic_results(tmp_path, extra))}
    layout = cases["nemotron-h-8b-4l zero1_bf16_optim"].layout
    assert (layout.main_grads_dtype, layout.exp_avg_dtype, layout.exp_avg_sq_dtype) == ("fp32", "fp32", "bf16")


def test_an_unknown_dtype_in_a_record_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"exp_avg_dtype must be 'fp32' or 'bf16', got 'fp16'"):
        ssm_cases(_synthetic_results(tmp_path, ["optim.exp_avg_dtype=fp16"]))
