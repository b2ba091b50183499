"""Block schedules of the flash-attention kernels: which tiles each program visits, built on the host.

A program owns one block of ``block`` rows of one segment (query rows in the forward and dQ kernels, key
rows in the dK/dV kernel) and loops over the segments of the other side that its segment is paired with
(:class:`~mcore.kernels.attention_layout.AttentionLayout`). The kernel clips each of those segments to the
positions its block can see (causal, window), so no program ever visits a tile outside every document: the
cost follows the sum of squared document lengths.

Blocks are listed heaviest first (longest visible key range), so that with more blocks than SMs the long
causal rows start first and the short ones fill the tail (longest-processing-time order).
"""

from __future__ import annotations

import functools

import torch

from mcore.kernels.attention_layout import AttentionLayout

# Columns of the block table: row, first token (in the row), rows in the block (<= block), position of the
# first row in its document, and the [lo, hi) range of this block's entries in the segment table.
BLOCK_COLUMNS = 6
# Columns of the segment table: first token (in the same row), length, position of the first token.
SEGMENT_COLUMNS = 3


def _visible(side: str, layout: AttentionLayout, first: int, last: int, other_len: int, other_pos: int) -> int:
    """How many rows of the other segment a block spanning positions [first, last] can see (an upper bound)."""
    lo, hi = 0, other_len
    window = layout.window_size
    if side == "q":  # keys j visible to queries first..last: j <= last (causal), j > first - W (window)
        if layout.causal:
            hi = min(hi, last - other_pos + 1)
        if window is not None:
            lo = max(lo, first - window + 1 - other_pos)
    else:  # queries i that see keys first..last: i >= first (causal), i < last + W (window)
        if layout.causal:
            lo = max(lo, first - other_pos)
        if window is not None:
            hi = min(hi, last + window - other_pos)
    return max(0, hi - lo)


@functools.lru_cache(maxsize=256)
def build_blocks(layout: AttentionLayout, side: str, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(blocks [n, 6], segments [m, 3])`` int32 CPU tables for programs over ``side`` ("q" or "k") blocks."""
    if side not in ("q", "k"):
        raise ValueError(f"build_blocks: side must be 'q' or 'k', got {side!r}")
    own, other = (slice(1, 4), slice(4, 7)) if side == "q" else (slice(4, 7), slice(1, 4))
    partners: dict[tuple[int, int, int, int], list[tuple[int, int, int]]] = {}
    for pair in layout.pairs:
        partners.setdefault((pair[0], *pair[own]), []).append(tuple(pair[other]))
    rows: list[tuple[int, ...]] = []
    work: list[int] = []
    segments: list[tuple[int, int, int]] = []
    for (row, start, length, pos), others in partners.items():
        seg_lo = len(segments)
        segments.extend(others)
        for offset in range(0, length, block):
            size = min(block, length - offset)
            first, last = pos + offset, pos + offset + size - 1
            rows.append((row, start + offset, size, first, seg_lo, len(segments)))
            work.append(sum(_visible(side, layout, first, last, n, p) for _, n, p in others))
    order = sorted(range(len(rows)), key=lambda i: -work[i])
    blocks = torch.tensor([rows[i] for i in order], dtype=torch.int32).reshape(-1, BLOCK_COLUMNS)
    segment_table = torch.tensor(segments, dtype=torch.int32).reshape(-1, SEGMENT_COLUMNS)
    return blocks, segment_table


@functools.lru_cache(maxsize=256)
def device_blocks(layout: AttentionLayout, side: str, block: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """:func:`build_blocks` on ``device``, shipped in one non-blocking copy and cached with the layout."""
    blocks, segments = build_blocks(layout, side, block)
    if device.type == "cpu":
        return blocks, segments
    packed = torch.cat([blocks.reshape(-1), segments.reshape(-1)]).pin_memory().to(device, non_blocking=True)
    return packed[: blocks.numel()].view(blocks.shape), packed[blocks.numel() :].view(segments.shape)
