"""``tools/pipeline_report.py``: the schedule drawings and bubble table of ``docs/parallelism.md`` are the ones the
code generates today, so the docs cannot drift from the schedules' real op orders."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "parallelism.md"


@pytest.fixture(scope="module")
def report():
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(ROOT / "tools"))
        import pipeline_report

        yield pipeline_report


def test_docs_hold_the_generated_drawings(report):
    """docs/parallelism.md shows each schedule's drawing as the code generates it today."""
    blocks = re.findall(r"```text\n(.*?)\n```", DOCS.read_text(), flags=re.S)
    for cls, pp, vpp, m in report.DRAWN_CASES:
        assert report.drawing(cls, pp, vpp, m) in blocks, f"regenerate the {cls.__name__} drawing in {DOCS}"


def test_the_bubble_table_agrees_with_the_formulas(report):
    cases = [(cls, 4, 2 if cls.__name__ == "Interleaved1F1B" else 1, 8) for cls in report.SCHEDULES[1:]]
    rows = report.bubble_table(cases).splitlines()[2:]
    assert len(rows) == len(cases)
    for row in rows:
        formula, replayed = row.strip("|").split("|")[-2:]
        assert float(formula) == float(replayed), row
