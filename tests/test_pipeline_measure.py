"""``benchmarks/pipeline_measure.py``: per-stage timelines from real spawned ranks (gloo), and a failing rank
ends the measurement with its error instead of leaving the parent waiting."""

from __future__ import annotations

import collections
import pathlib

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def pm():
    """The tool's module, imported as the benchmarks import each other (their folder on sys.path, which the
    spawned ranks inherit, so that they find the worker function)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(BENCH))
        import pipeline_measure

        yield pipeline_measure


SMALL = dict(hidden=16, ffn=32, seq=8, micro_batch=2, layers_per_chunk=1, runs=2)


def test_measure_returns_every_stage_timeline_of_every_run(pm):
    jobs = [("OneFOneB", 1, 3), ("Interleaved1F1B", 2, 4), ("ZeroBubbleH1", 1, 3)]
    results = pm.measure(2, jobs, pm.MeasureConfig(**SMALL))
    assert list(results) == jobs
    for (name, vpp, m), runs in results.items():
        assert len(runs) == SMALL["runs"]
        for stages in runs:
            assert [t.pp_rank for t in stages] == [0, 1]
            for t in stages:
                kinds = collections.Counter(op.op.kind for op in t.ops)
                # every micro-batch passes forward and backward through each of this rank's chunks once
                assert kinds["F"] == m * vpp, (name, kinds)
                assert kinds["B"] == m * vpp, (name, kinds)
                assert kinds["W"] == (m if name == "ZeroBubbleH1" else 0), (name, kinds)
                assert t.start <= min(op.start for op in t.ops) and max(op.end for op in t.ops) <= t.end
                assert 0.0 < t.busy <= t.end - t.start


def test_a_failing_rank_ends_the_measurement_with_its_error(pm):
    with pytest.raises(RuntimeError, match=r"rank \d failed:(.|\n)*unknown schedule 'OneFTwoB'"):
        pm.measure(2, [("OneFTwoB", 1, 2)], pm.MeasureConfig(**SMALL))
