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
