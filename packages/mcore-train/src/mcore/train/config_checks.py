"""Range checks shared by the config sections; each message names ``section.field`` and the value."""

from __future__ import annotations


def positive(section: str, name: str, value: int | float) -> None:
    if value <= 0:
        raise ValueError(f"{section}.{name} must be > 0, got {value}")


def non_negative(section: str, name: str, value: int | float) -> None:
    if value < 0:
        raise ValueError(f"{section}.{name} must be >= 0, got {value}")
