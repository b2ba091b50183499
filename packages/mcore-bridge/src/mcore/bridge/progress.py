"""The conversion progress bar: bytes written, with the tensor count beside it."""

from __future__ import annotations

from tqdm import tqdm


class Progress:
    """A tqdm bar over bytes whose postfix counts tensors; ``enabled=None`` shows it only on a terminal."""

    def __init__(self, total_bytes: int, total_tensors: int, description: str, enabled: bool | None = None):
        self._tensors = 0
        self._total_tensors = total_tensors
        self._bar = tqdm(
            total=total_bytes,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc=description,
            disable=None if enabled is None else not enabled,
            dynamic_ncols=True,
        )

    def advance(self, nbytes: int, tensors: int = 1) -> None:
        self._tensors += tensors
        self._bar.set_postfix_str(f"{self._tensors}/{self._total_tensors} tensors", refresh=False)
        self._bar.update(nbytes)

    def close(self) -> None:
        self._bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
