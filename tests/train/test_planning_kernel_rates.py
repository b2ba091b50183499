"""The calibration's GEMM and attention rates against the kernel benchmarks' raw results (``kernel_rates``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mcore.train.planning.calibration import load_calibration
from mcore.train.planning.kernel_rates import _gemm_shapes, attention_rows, gemm_rows, gemm_run_rates

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
H200 = load_calibration("h200-sxm")


def test_every_linear_of_the_fp8_table_in_bf16_and_fp8():
    rows = gemm_rows(RESULTS, H200)
    names = {r.name.split()[0] for r in rows}
    assert names == {"qkv", "out_proj", "gate_up", "down"} and len(rows) == 8
    assert all(r.runs >= 2 for r in rows)  # the interim and the final call's tables (a copied run counted once)
    assert _gemm_shapes(8192, 6144, 4096) == {"fwd": (8192, 6144, 4096), "dgrad": (8192, 4096, 6144),
                                              "wgrad": (6144, 4096, 8192)}  # fmt: skip


def test_gemm_rates_within_ten_percent_but_the_down_projection():
    """Every linear within 10%, bf16 and FP8, but ``down``, 11-14% slower in fp8.py's tables than the curve: its
    input-gradient GEMM is the curve's own 8192 x 14336 x 4096 point (765 TFLOP/s in --calibrate, 671 and 575 in
    the two fp8.py runs): a spread between runs, not of the curve (docs/scaling.md, section 1)."""
    rows = gemm_rows(RESULTS, H200)
    for r in rows:
        limit = 0.15 if r.name.startswith("down") else 0.10
        assert abs(r.error) <= limit, (r.name, r.measured_ms, r.predicted_ms)
    assert any(r.name.startswith("down") and abs(r.error) > 0.10 for r in rows)  # the known gap


def test_attention_rows_within_ten_percent_one_document_and_packed():
    """SDPA on one document (fwd+bwd) and mcore's kernel on packed documents (fwd and bwd apart, at the
    calibration's packed_attention rate for the document length) within 10%; the kernel's rows from before its
    backward rework are listed, far off (the calibration describes today's kernel)."""
    rows = attention_rows(RESULTS, H200)
    checked = [r for r in rows if r.checked]
    assert any("1x16384" in r.name and "sdpa" in r.name for r in checked)
    packed = [r for r in checked if "sdpa" not in r.name]
    assert {r.name.split()[1] for r in packed} == {"128x128", "32x512"}
    assert {r.name.split()[2] for r in packed} == {"fwd", "bwd"}
    for r in checked:
        assert r.predicted_ms == pytest.approx(r.measured_ms, rel=0.10), r
    listed = [r for r in rows if not r.checked]
    assert listed and all(r.name.endswith("attention-h200-2026-12-01)") for r in listed)
    assert any(abs(r.error) > 0.5 for r in listed)  # the old backward, 3-4x slower than today's


def test_down_gemm_spread_between_runs_on_one_shape():
    """The down GEMM row's gap is spread, not shape: the curve's own point (8192, 14336, 4096) in bf16 and FP8
    measured in three runs differs by more than the row's error, and the two fp8.py runs order down's three
    GEMMs differently (no GEMM of the shape slow in both)."""
    rates = gemm_run_rates(RESULTS, "down")
    for precision in ("bf16", "fp8"):
        point = [r for r in rates if r[1] == precision and r[2] == (8192, 14336, 4096)]
        assert len({r[3] for r in point}) == 3, point  # --calibrate and the two fp8.py calls
        values = [r[4] for r in point]
        assert max(values) / min(values) > 1.2, values
    bf16 = {(r[0], r[3]): r[4] for r in rates if r[1] == "bf16" and "calibrate" not in r[3]}
    runs = sorted({run for _, run in bf16})
    slowest = {run: min(("fwd", "dgrad", "wgrad"), key=lambda g: bf16[(g, run)]) for run in runs}
    assert len(set(slowest.values())) == len(runs) == 2, slowest
