"""Shared step start of the tests that check a GEMM writes ``main_grad`` instead of adding into it."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def start_step(ddp, params: Iterable[torch.Tensor], poison: bool) -> None:
    """DDP's ``zero_grad_buffer``, then with ``poison`` NaN in every ``main_grad`` of ``params``: whatever reads one
    before writing it turns NaN, which a test of the write-first path can see."""
    ddp.zero_grad_buffer()
    if poison:
        for p in params:
            p.main_grad.fill_(float("nan"))


def record_wgrad_targets(monkeypatch) -> list[bool]:
    """Record, in order, whether each expert weight-gradient GEMM that took a ``main_grad`` target overwrote it
    (``expert_gemm.take_wgrad_target`` wrapped for the test)."""
    import mcore.parallel.expert_gemm as expert_gemm

    taken: list[bool] = []
    # the real function, also when an earlier recorder of the same test is still installed (it would record twice)
    real = getattr(expert_gemm.take_wgrad_target, "__wrapped__", expert_gemm.take_wgrad_target)

    def recording_take(w):
        target, overwrite = real(w)
        if target is not None:
            taken.append(overwrite)
        return target, overwrite

    recording_take.__wrapped__ = real
    monkeypatch.setattr(expert_gemm, "take_wgrad_target", recording_take)
    return taken
