"""Shared fixtures of the kernel tests: the Triton interpreter on CPU, tolerances, backend spies.

Triton reads ``TRITON_INTERPRET`` when a kernel module is first imported (``@triton.jit`` decides then
whether to build an interpreted function), and the mcore kernel modules are imported lazily, on the
first Triton call. Setting the variable here, before any test runs, therefore makes the Triton backend
run on CPU tensors through the interpreter. It is only set when no CUDA device is present, so that on a
GPU machine the ``gpu``-marked tests compile and run the real kernels; the interpreter tests then skip.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from mcore.kernels import dispatch  # noqa: E402  (after the environment is settled)

# Elementwise tolerances (rtol, atol relative to the reference's largest magnitude) for comparing two
# computations that both accumulate in fp32 and round once to the output dtype: a few units in the
# last place of that dtype.
_TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
    torch.float64: (1e-12, 1e-12),
}


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    dtype = dtype or actual.dtype
    rtol, atol = _TOLERANCES[dtype]
    assert actual.shape == expected.shape, f"shape {tuple(actual.shape)} != expected {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), "non-finite values in the result"
    expected = expected.to(actual.device, torch.float64)
    scale = max(1.0, expected.abs().max().item()) if expected.numel() else 1.0
    torch.testing.assert_close(actual.to(torch.float64), expected, rtol=rtol, atol=atol * scale)


@pytest.fixture
def assert_close() -> Callable[..., None]:
    """``assert_close(actual, expected, dtype=None)``: equal within a few ulps of ``dtype`` (default: actual's)."""
    return _assert_close


@pytest.fixture
def interpreter() -> torch.device:
    """Device for running the Triton kernels under the CPU interpreter; skips when not interpreting."""
    try:
        importlib.import_module("triton")
    except ImportError:
        pytest.skip("triton is not installed")
    if not dispatch.triton_interpreting():
        pytest.skip("TRITON_INTERPRET=1 is not set (on a CUDA machine the gpu-marked tests cover Triton)")
    return torch.device("cpu")


@pytest.fixture
def cuda_triton() -> torch.device:
    """The CUDA device for compiled-Triton tests; skips under the interpreter, which would not compile them."""
    if dispatch.triton_interpreting():
        pytest.skip("TRITON_INTERPRET=1 is set: the kernels would be interpreted, not compiled")
    return torch.device("cuda")


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> Callable[[str, str], list]:
    """``spy("mcore.kernels.triton.norms", "norm_forward")`` wraps a function and returns its call log."""

    def install(module_name: str, attribute: str) -> list:
        module = importlib.import_module(module_name)
        original = getattr(module, attribute)
        calls: list = []

        def wrapper(*args, **kwargs):
            calls.append((args, kwargs))
            return original(*args, **kwargs)

        monkeypatch.setattr(module, attribute, wrapper)
        return calls

    return install


@pytest.fixture
def forbid(monkeypatch: pytest.MonkeyPatch) -> Callable[[str, str], None]:
    """``forbid(module, name)`` makes a function fail the test if called (e.g. a kernel launch on bad input)."""

    def install(module_name: str, attribute: str) -> None:
        module = importlib.import_module(module_name)

        def fail(*args, **kwargs):
            raise AssertionError(f"{module_name}.{attribute} must not be called")

        monkeypatch.setattr(module, attribute, fail)

    return install
