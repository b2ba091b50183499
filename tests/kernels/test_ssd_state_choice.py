"""``STATE_MATMULS = "auto"``: the measured choice between the Triton and the torch state matmuls of the SSD (the
steps it times run for real, under the interpreter; the clock is the test's)."""

from __future__ import annotations

import pytest
import torch


def _inputs(chunk_states=None):
    import mcore.kernels.ssd_triton as glue

    parts = (chunk_states or glue.chunk_states, glue.inter_output)
    b, nc, q, g, h, p, n = 1, 2, 4, 1, 2, 4, 3
    gen = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    return parts, r(b, nc * q, h, p), r(b, nc * q, h), r(b, nc * q, g, n), r(b, nc * q, g, n), r(b, nc * q, h), (
        b, nc, q, g, h, p, n)  # fmt: skip


@pytest.fixture
def choice(monkeypatch):
    from mcore.kernels import ssd_state_choice

    monkeypatch.setattr(ssd_state_choice, "CHOSEN", {})
    return ssd_state_choice


def test_the_faster_path_is_chosen_once_per_shape(interpreter, choice):
    times = {"triton": 2.0, "torch": 1.0}
    timed = []

    def seconds(step, calls):
        step()  # forward + backward of the path for real: both must run
        path = ("triton", "torch")[len(timed)]
        timed.append(path)
        return times[path]

    args = _inputs()
    assert choice.choose_state_matmuls(*args, seconds=seconds) == "torch"
    assert choice.choose_state_matmuls(*args, seconds=seconds) == "torch" and timed == ["triton", "torch"]
    times.update(triton=0.5, torch=1.0)
    choice.CHOSEN.clear()
    timed.clear()
    assert choice.choose_state_matmuls(*args, seconds=seconds) == "triton"


def test_a_triton_path_that_fails_loses(interpreter, choice, caplog):
    import mcore.kernels.ssd_triton as glue

    real = glue.chunk_states

    def chunk_states(path, *a):
        if path == "triton":
            raise RuntimeError("no kernel for this GPU")
        return real(path, *a)

    with caplog.at_level("WARNING", logger="mcore.kernels"):
        args = _inputs(chunk_states)
        assert choice.choose_state_matmuls(*args, seconds=lambda step, calls: step() or 1.0) == "torch"
    assert "Triton state matmuls failed" in caplog.text


def test_off_cuda_the_triton_kernels_run_untimed(interpreter, choice):
    assert choice.choose_state_matmuls(*_inputs()) == "triton" and choice.CHOSEN == {}


def test_unknown_setting_is_refused(monkeypatch):
    import importlib

    import mcore.kernels.ssd_triton as glue

    monkeypatch.setenv("MCORE_SSD_STATE_MATMULS", "fastest")
    with pytest.raises(ValueError, match="MCORE_SSD_STATE_MATMULS must be 'auto', 'triton' or 'torch'"):
        importlib.reload(glue)
    monkeypatch.delenv("MCORE_SSD_STATE_MATMULS")
    importlib.reload(glue)
