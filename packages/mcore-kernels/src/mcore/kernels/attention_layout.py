"""Which queries see which keys: attention as a list of (query segment, key segment) pairs.

One description serves every masked-attention case the library has: one causal document per row, packed
documents (``cu_seqlens``), sliding windows, and the blocks of context-parallel attention, where a rank's
queries are two chunks of each document and the keys arriving from a peer are two other chunks.

A pair ``(row, q_start, q_len, q_pos, k_start, k_len, k_pos)`` says that queries
``q[row, q_start : q_start + q_len]`` may attend to keys ``k[row, k_start : k_start + k_len]``; their positions
inside their document are ``q_pos + i`` and ``k_pos + j``. Within a pair, ``causal`` allows ``k_pos + j <=
q_pos + i`` and ``window_size`` W allows ``k_pos + j > q_pos + i - W``. Queries of different pairs never mix
(different documents), and a query row that is in no pair sees nothing (output 0, log-sum-exp ``-inf``).

The Triton kernel visits only the tiles of listed pairs, so its cost follows the sum over pairs of
``q_len * k_len`` (halved by the causal rule), never ``s^2``.
"""

from __future__ import annotations

import dataclasses
import functools

import torch


@dataclasses.dataclass(frozen=True)
class AttentionLayout:
    """Visibility of ``[batch, q_len]`` queries over ``[batch, k_len]`` keys as segment pairs (see module doc)."""

    batch: int
    q_len: int
    k_len: int
    causal: bool
    window_size: int | None
    pairs: tuple[tuple[int, int, int, int, int, int, int], ...]

    def __post_init__(self) -> None:
        for name in ("batch", "q_len", "k_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"AttentionLayout: {name} must be an int >= 1, got {value!r}")
        if self.window_size is not None and (not self.causal or self.window_size < 1):
            raise ValueError(f"AttentionLayout: window_size needs causal=True and W >= 1, got {self.window_size!r}")
        for pair in self.pairs:
            if len(pair) != 7:
                raise ValueError(
                    f"AttentionLayout: a pair has 7 ints (row, q_start, q_len, q_pos, k_start, ...): {pair}"
                )
            row, q_start, q_len, _, k_start, k_len, _ = pair
            if not (0 <= row < self.batch and q_len >= 1 and k_len >= 1):
                raise ValueError(f"AttentionLayout: pair {pair} has a row outside [0, {self.batch}) or an empty side")
            if q_start < 0 or q_start + q_len > self.q_len or k_start < 0 or k_start + k_len > self.k_len:
                raise ValueError(
                    f"AttentionLayout: pair {pair} runs outside the {self.q_len} queries / {self.k_len} keys of a row"
                )
        _check_disjoint(self.pairs, 0, "query")
        _check_disjoint(self.pairs, 3, "key")
        # Layouts key the schedule caches on every call: hash the pairs once, not per lookup.
        object.__setattr__(
            self, "_hash", hash((self.batch, self.q_len, self.k_len, self.causal, self.window_size, self.pairs))
        )
        object.__setattr__(self, "_covers", {})

    def __hash__(self) -> int:
        return self._hash

    @classmethod
    def from_documents(
        cls,
        batch: int,
        q_len: int,
        k_len: int,
        *,
        causal: bool,
        window_size: int | None = None,
        bounds: list[int] | tuple[int, ...] | None = None,
    ) -> AttentionLayout:
        """Each row one document, or the documents of ``bounds`` (cumulative lengths over ``batch * q_len``).

        Cached: a training step asks for the same layout in every layer, and the kernels' schedules are
        cached by layout, so the host work happens once per distinct batch layout.
        """
        return _documents_layout(batch, q_len, k_len, causal, window_size, None if bounds is None else tuple(bounds))

    @classmethod
    def _from_documents(cls, batch, q_len, k_len, causal, window_size, bounds) -> AttentionLayout:
        if bounds is None:
            pairs = tuple((row, 0, q_len, 0, 0, k_len, 0) for row in range(batch))
        else:
            pairs = tuple(
                (lo // q_len, lo % q_len, hi - lo, 0, lo % q_len, hi - lo, 0)
                for lo, hi in zip(bounds, bounds[1:])
                if hi > lo
            )
        return cls(batch, q_len, k_len, causal, window_size, pairs)

    def allowed_pair(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """Bool ``[len(q_pos), len(k_pos)]``: the causal/window rule inside one pair."""
        allowed = torch.ones(q_pos.numel(), k_pos.numel(), dtype=torch.bool, device=q_pos.device)
        if self.causal:
            allowed &= k_pos[None, :] <= q_pos[:, None]
        if self.window_size is not None:
            allowed &= k_pos[None, :] > q_pos[:, None] - self.window_size
        return allowed

    def dense_mask(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Bool ``[batch, q_len, k_len]``: True where a query may attend to a key (for the reference path)."""
        return _dense_mask(self, str(device))

    def work(self) -> int:
        """Number of (query, key) pairs allowed: the attention work the layout asks for."""
        total = 0
        for _, _, q_len, q_pos, _, k_len, k_pos in self.pairs:
            total += int(self.allowed_pair(torch.arange(q_len) + q_pos, torch.arange(k_len) + k_pos).sum())
        return total

    def covers_all(self, side: str) -> bool:
        """Whether every query (``side="q"``) or key (``"k"``) row belongs to some pair."""
        if side not in self._covers:
            offset, length = (1, self.q_len) if side == "q" else (4, self.k_len)
            segments = {(p[0], p[offset], p[offset + 1]) for p in self.pairs}
            self._covers[side] = sum(n for _, _, n in segments) == self.batch * length
        return self._covers[side]


def _check_disjoint(pairs: tuple, offset: int, what: str) -> None:
    """Segments of one side are either the same segment or do not overlap (a token has one position)."""
    segments = sorted({(p[0], p[offset + 1], p[offset + 2], p[offset + 3]) for p in pairs})
    for (row_a, start_a, len_a, _), (row_b, start_b, _, _) in zip(segments, segments[1:]):
        if row_a == row_b and start_b < start_a + len_a:
            raise ValueError(
                f"AttentionLayout: two different {what} segments overlap in row {row_a} "
                f"(at {start_a}+{len_a} and {start_b}); a token must have one position"
            )


@functools.lru_cache(maxsize=64)
def _documents_layout(batch, q_len, k_len, causal, window_size, bounds) -> AttentionLayout:
    return AttentionLayout._from_documents(batch, q_len, k_len, causal, window_size, bounds)


@functools.lru_cache(maxsize=64)
def _dense_mask(layout: AttentionLayout, device: str) -> torch.Tensor:
    mask = torch.zeros(layout.batch, layout.q_len, layout.k_len, dtype=torch.bool)
    for row, q_start, q_len, q_pos, k_start, k_len, k_pos in layout.pairs:
        rule = layout.allowed_pair(torch.arange(q_len) + q_pos, torch.arange(k_len) + k_pos)
        mask[row, q_start : q_start + q_len, k_start : k_start + k_len] |= rule
    return mask.to(device)
