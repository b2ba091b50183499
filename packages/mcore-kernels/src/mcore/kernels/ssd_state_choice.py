"""``STATE_MATMULS = "auto"`` of :mod:`mcore.kernels.ssd_triton`: which implementation of the SSD's two state
matmuls (the chunk states and the inter-chunk output) runs on a shape, measured once per shape.

Why measure: the two are close in cost on some shapes and far apart on others (the Triton kernels read the input
dtype and save only their inputs; torch's fp32 batched matmuls read fp32 copies), and a model runs the same shape
for a whole training run, so one timing of forward + backward on the first call (a few milliseconds, like cuDNN's
benchmark mode) picks for all the rest. A Triton path that raises (a kernel that does not build on this GPU) loses
the choice, with a warning, instead of ending the run. Off CUDA the choice is ``"triton"`` without timing (the
interpreter tests run those kernels). The choices are kept in :data:`CHOSEN`, logged once each.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable

import torch

logger = logging.getLogger("mcore.kernels")

PATHS = ("triton", "torch")
TIMED_CALLS = 3
CHOSEN: dict[tuple, str] = {}


def _cuda_seconds(fn: Callable[[], None], calls: int) -> float:
    fn()  # builds the kernels; not timed
    torch.cuda.synchronize()
    times = []
    for _ in range(calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _state_step(path: str, parts, xp, w, Bp, Cp, v, dims) -> Callable[[], None]:
    """Forward + backward of both state matmuls on ``path``, on detached copies of the real inputs (the incoming
    states, computed between the two, are stood in for by a tensor of their shape)."""
    chunk_states, inter_output = parts
    b, nc, q, g, h, p, n = dims
    leaves = [t.detach().requires_grad_() for t in (xp, w, Bp, Cp, v)]
    incoming = torch.randn(b, nc, h, p * n, device=xp.device).requires_grad_()

    def step() -> None:
        # Identity hooks shadow any outer saved-tensor hooks (a checkpointed or offloaded layer's forward is where
        # the first call happens): this private graph must not be packed for their recompute or offload.
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            x_, w_, B_, C_, v_ = leaves
            local = chunk_states(path, x_, w_, B_, dims)
            inter = inter_output(path, C_, incoming, v_, dims)
            torch.autograd.backward([local, inter], [torch.ones_like(local), torch.ones_like(inter)])

    return step


def choose_state_matmuls(parts, xp, w, Bp, Cp, v, dims, seconds: Callable[..., float] | None = None) -> str:
    """``"triton"`` or ``"torch"`` for these inputs' shape (see the module docstring). ``parts`` are the two
    matmuls, ``(chunk_states, inter_output)`` of :mod:`mcore.kernels.ssd_triton`, each taking the path first;
    ``seconds(step, calls)`` times a step (CUDA events by default; tests pass their own)."""
    if not xp.is_cuda and seconds is None:
        return "triton"
    key = (tuple(dims), xp.dtype, Bp.dtype, str(xp.device))
    if key in CHOSEN:
        return CHOSEN[key]
    seconds = seconds or _cuda_seconds
    timings: dict[str, float] = {}
    for path in PATHS:
        try:
            timings[path] = seconds(_state_step(path, parts, xp, w, Bp, Cp, v, dims), TIMED_CALLS)
        except Exception as exc:  # a path that cannot run here loses; the other one still can
            if path == "torch":
                raise
            logger.warning("mcore.kernels.ssd_scan: the Triton state matmuls failed (%s); using torch's", exc)
    choice = min(timings, key=timings.get)
    CHOSEN[key] = choice
    shown = ", ".join(f"{k} {t * 1e3:.3f} ms" for k, t in timings.items())
    logger.info("mcore.kernels.ssd_scan: state matmuls on %s for dims %s (%s, forward + backward)", choice, dims, shown)
    return choice
