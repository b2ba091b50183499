"""The calibration's GEMM and attention rates against the kernel benchmarks' raw results (``kernel_rates``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mcore.train.planning.calibration import load_calibration
from mcore.train.planning.kernel_rates import _gemm_shapes, attention_rows, gemm_rows

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


def test_single_document_attention_within_ten_percent():
    rows = attention_rows(RESULTS, H200)
    checked = [r for r in rows if r.checked]
    assert checked and all("1x" in r.name and "sdpa" in r.name for r in checked)
    for r in checked:
        assert r.predicted_ms == pytest.approx(r.measured_ms, rel=0.10), r
    assert any(not r.checked for r in rows)  # packed documents are listed, not checked
