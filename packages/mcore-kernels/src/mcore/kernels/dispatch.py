"""Pick the implementation of an op: the Triton kernel or the pure-torch reference.

Order of precedence: the ``backend=`` keyword of the op, then the ``MCORE_KERNELS_BACKEND``
environment variable, then the device (CUDA tensors -> Triton when it imports, anything else -> the
reference). ``TRITON_INTERPRET=1`` lets the Triton kernels run on CPU tensors (tests). The choice is
logged once per (op, backend, reason), so a silent fallback can never hide.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os

import torch

logger = logging.getLogger("mcore.kernels")

TRITON = "triton"
REFERENCE = "reference"
_KERNEL_BACKENDS = (TRITON, REFERENCE)
_logged: set[tuple[str, str, str]] = set()


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _log_once(op: str, backend: str, reason: str) -> None:
    key = (op, backend, reason)
    if key not in _logged:
        _logged.add(key)
        logger.info("mcore.kernels.%s: using the %s backend (%s)", op, backend, reason)


def choose(op: str, *tensors: torch.Tensor, backend: str | None = None, extra: tuple[str, ...] = ()) -> str:
    """Return the backend name for ``op`` on ``tensors``.

    ``extra`` names further backends the op accepts besides ``triton`` and ``reference`` (attention's
    ``sdpa`` and ``flex``); an explicit request for one of those is returned as is.
    """
    allowed = _KERNEL_BACKENDS + tuple(extra)
    requested, source = backend, "keyword"
    if requested is None and os.environ.get("MCORE_KERNELS_BACKEND"):
        requested, source = os.environ["MCORE_KERNELS_BACKEND"], "MCORE_KERNELS_BACKEND"
    if requested is not None:
        if requested not in allowed:
            raise ValueError(f"{op}: unknown backend {requested!r} (from {source}); expected one of {allowed}")
        if requested == TRITON:
            on_cuda = all(t.is_cuda for t in tensors)
            if not triton_available() or not (on_cuda or triton_interpreting()):
                why = "triton is not installed" if not triton_available() else "tensors are not on CUDA"
                _log_once(op, REFERENCE, f"{source} asked for triton but {why}; falling back")
                return REFERENCE
        _log_once(op, requested, f"requested by {source}")
        return requested
    if tensors and all(t.is_cuda for t in tensors):
        if triton_available():
            _log_once(op, TRITON, "CUDA tensors")
            return TRITON
        _log_once(op, REFERENCE, "CUDA tensors but triton is not installed; falling back")
        return REFERENCE
    _log_once(op, REFERENCE, "tensors not on CUDA")
    return REFERENCE
