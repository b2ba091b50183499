"""The host-side scalars of one AdamW update, shared by the reference and the Triton kernel (a module of its own so
that ``optimizer`` and ``triton.adamw`` both import it instead of each other)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AdamWScalars:
    """The per-call scalars of the update, computed once on the host in double precision.

    ``decay`` is ``1 - lr * weight_decay`` (``None`` when ``weight_decay == 0``, so the multiply is skipped as
    torch skips it), ``step_size`` is ``lr / (1 - beta1**steps)`` and ``bias_correction2_sqrt`` is
    ``sqrt(1 - beta2**steps)``.
    """

    decay: float | None
    beta1: float
    one_minus_beta1: float
    beta2: float
    one_minus_beta2: float
    step_size: float
    bias_correction2_sqrt: float
    eps: float

    @classmethod
    def of(cls, *, steps: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> AdamWScalars:
        return cls(
            decay=None if weight_decay == 0 else 1.0 - lr * weight_decay,
            beta1=float(beta1),
            one_minus_beta1=1.0 - beta1,
            beta2=float(beta2),
            one_minus_beta2=1.0 - beta2,
            step_size=lr / (1.0 - beta1**steps),
            bias_correction2_sqrt=(1.0 - beta2**steps) ** 0.5,
            eps=float(eps),
        )
