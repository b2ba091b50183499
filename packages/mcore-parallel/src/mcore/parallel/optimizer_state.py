"""The optimizers' state checks: the storage dtypes of the Adam moments, what a loaded state dict must hold, and
which of its tensors are cast to this optimizer's dtypes (a checkpoint saved with fp32 moments loads into bf16
ones and back)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["MOMENT_DTYPES", "check_loaded_state", "loaded_casts", "moment_dtypes"]

MOMENT_DTYPES = (torch.float32, torch.bfloat16)


def check_loaded_state(
    state: object, shapes: dict[str, tuple[int, ...]], kinds: Sequence[str], strict: bool
) -> dict[str, torch.Tensor]:
    """``state["tensors"]`` after checking it holds ``"<name>/<kind>"`` of ``shapes[name]`` for every name and kind
    (``strict``: and nothing else); one clear ``ValueError`` otherwise."""
    if not isinstance(state, dict) or "tensors" not in state or "step" not in state:
        raise ValueError("optimizer.load_state_dict: expected a dict with 'step' and 'tensors' (see state_dict())")
    tensors = state["tensors"]
    expected = {f"{name}/{k}" for name in shapes for k in kinds}
    missing = sorted(expected - set(tensors))
    extra = sorted(set(tensors) - expected)
    if missing or (strict and extra):
        raise ValueError(
            f"optimizer.load_state_dict: missing {missing[:6]}{'...' if len(missing) > 6 else ''}, "
            f"unexpected {extra[:6]}{'...' if len(extra) > 6 else ''} (strict={strict})"
        )
    for name, shape in shapes.items():
        for k in kinds:
            t = tensors[f"{name}/{k}"]
            if tuple(t.shape) != shape:
                raise ValueError(
                    f"optimizer.load_state_dict: {name}/{k} has shape {tuple(t.shape)}, the TP-local "
                    f"parameter has {shape}; reshard the checkpoint for this tensor-parallel size"
                )
            if not t.is_floating_point():
                raise ValueError(f"optimizer.load_state_dict: {name}/{k} is {t.dtype}, expected a floating tensor")
    return tensors


def moment_dtypes(exp_avg_dtype: object, exp_avg_sq_dtype: object) -> dict[str, torch.dtype]:
    out = {}
    for name, dtype in (("exp_avg", exp_avg_dtype), ("exp_avg_sq", exp_avg_sq_dtype)):
        if dtype not in MOMENT_DTYPES:
            raise ValueError(
                f"optimizer: {name}_dtype must be torch.float32 or torch.bfloat16, got {dtype!r} (fp16 moments "
                "underflow without a per-tensor scale)"
            )
        out[name] = dtype
    return out


def loaded_casts(tensors: dict[str, torch.Tensor], dtypes: dict[str, torch.dtype]) -> list[str]:
    """One line per state kind whose loaded tensors are cast: ``"exp_avg: float32 -> bfloat16"``."""
    seen: dict[str, set[torch.dtype]] = {}
    for key, t in tensors.items():
        kind = key.rsplit("/", 1)[-1]
        if kind in dtypes and t.dtype != dtypes[kind]:
            seen.setdefault(kind, set()).add(t.dtype)
    name = lambda d: str(d).removeprefix("torch.")  # noqa: E731
    return [
        f"{kind}: {', '.join(sorted(map(name, got)))} -> {name(dtypes[kind])}" for kind, got in sorted(seen.items())
    ]
