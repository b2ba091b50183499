"""The golden loss curves of ``tests/golden/`` (each family's tiny preset and the demo, 20 fp32 CPU steps) must not
change: a refactor of the model or the training path that moves a loss has changed behaviour."""

from __future__ import annotations

import json

import pytest

from tests.golden.curves import RUNS, STEPS, path_of, platform_key, train_curve


@pytest.mark.parametrize("name", sorted(RUNS))
def test_golden_loss_curve_unchanged(name):
    golden = json.loads(path_of(name).read_text())
    assert golden["overrides"] == RUNS[name], "the run's overrides changed: re-record only on purpose"
    curve = train_curve(name)
    assert len(curve) == len(golden["losses"]) == STEPS
    if golden["platform"] == platform_key():
        assert curve == golden["losses"], f"{name}: bitwise different on the recording platform"
    else:
        assert curve == pytest.approx(golden["losses"], rel=1e-6, abs=0), name
