"""Shared by the mcore.parallel tests: error measures and a per-case runner for spawned workers."""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

import torch


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| (shapes must match exactly)."""
    if actual.shape != expected.shape:
        raise AssertionError(f"shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    a, e = actual.detach().double(), expected.detach().double()
    scale = e.abs().max().item()
    if scale == 0.0:
        raise AssertionError("expected tensor is all zeros: the comparison would not test anything")
    return (a - e).abs().max().item() / scale


def rel_err_norm(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| (Frobenius).

    Used for parameters after several AdamW steps: Adam divides each element's update by the root of its
    own second moment, so an element whose gradient is near zero turns a rounding difference of the
    reduction order (dp/tp sums) into a larger relative change of that one element; the tensor-wise error
    stays at the level of the rounding.
    """
    if actual.shape != expected.shape:
        raise AssertionError(f"shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    a, e = actual.detach().double(), expected.detach().double()
    scale = e.norm().item()
    if scale == 0.0:
        raise AssertionError("expected tensor is all zeros: the comparison would not test anything")
    return (a - e).norm().item() / scale


def run_cases(cases: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    """Run each case; a failure is recorded as its traceback so that the other cases still report."""
    out: dict[str, Any] = {}
    for name, fn in cases.items():
        try:
            out[name] = fn()
        except Exception:  # noqa: BLE001 - turned into a test failure in the parent
            out[name] = {"error": traceback.format_exc()}
    return out


def case_result(results: list[dict[str, Any]], name: str) -> list[Any]:
    """Every rank's result of case ``name``; fails with the worker's traceback if a rank raised."""
    per_rank = []
    for rank, res in enumerate(results):
        value = res[name]
        if isinstance(value, dict) and "error" in value:
            raise AssertionError(f"case {name!r} failed on rank {rank}:\n{value['error']}")
        per_rank.append(value)
    return per_rank
