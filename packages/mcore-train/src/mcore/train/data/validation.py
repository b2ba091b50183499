"""Argument checks shared by the data modules; messages name the argument, the rule and the value received."""

from __future__ import annotations

from typing import Any

import numpy as np


def check_int(name: str, value: Any, minimum: int) -> int:
    """``value`` as an int, after checking that it is an integer (not a bool) and at least ``minimum``."""
    if not isinstance(value, int | np.integer) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def check_index(index: Any, length: int, what: str) -> int:
    """``index`` into ``length`` items (negative counts from the end) as a non-negative int.

    ``what`` names the items in the message, e.g. ``"sequences in 'data/web'"``.
    """
    if not isinstance(index, int | np.integer) or isinstance(index, bool):
        raise TypeError(f"index into {what} must be an int, got {type(index).__name__}")
    i = int(index) + length if index < 0 else int(index)
    if not 0 <= i < length:
        raise IndexError(f"index {index} out of range for {length} {what}")
    return i


def check_span(sequence: int, size: int, offset: int, length: int | None) -> int:
    """The length of the read ``offset : offset + length`` of a sequence of ``size`` tokens (to its end if None)."""
    if length is None:
        length = size - offset
    if offset < 0 or length < 0 or offset + length > size:
        raise IndexError(f"read of {length} tokens at offset {offset} exceeds sequence {sequence} of {size} tokens")
    return length
