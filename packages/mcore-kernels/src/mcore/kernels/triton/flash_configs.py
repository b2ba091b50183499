"""Tile configurations of the flash-attention kernels, per head dim and document length.

Each kernel launch takes a :class:`FlashConfig`: ``block_m`` rows of the program's own block (query rows for
the forward and dQ kernels, key rows for the dK/dV kernel), ``block_n`` rows of the other side per loop step,
warps and software-pipeline stages. The best tiles depend on the head dim (registers and shared memory per
row) and on how long the documents are (a 128-token document is a single tile: small tiles and more
programs per SM hide its latency; long documents want large tiles and deep pipelines).

The table is keyed by (widest head dim bucket, longest document bucket). When every document fits in one
key block of the dK/dV kernel, that kernel also writes dQ (each query then sees all its keys in one
program: exact, no atomics) and the separate dQ kernel does not run; ``fused_dq_possible`` decides it.

Values: chosen by ``benchmarks/attention.py --sweep`` on one H200 (Triton 3.6, bf16, Hq 32, Hkv 8); the
measurements they come from are in ``benchmarks/results/`` (see ``MEASURED`` below).
"""

from __future__ import annotations

import dataclasses
import functools

from mcore.kernels.attention_layout import AttentionLayout


@dataclasses.dataclass(frozen=True)
class FlashConfig:
    """Tile sizes of one kernel launch (rows of the program's own block x rows of the other side)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    # One loop over a segment's blocks with the mask applied where a block needs it, instead of three loops
    # (window edge, interior, diagonal): sm90 compiles of the three-loop form spill registers (ptxas, Triton 3.9).
    one_loop: bool = True
    # A tile's rows are (query, head) pairs over the GQA group's heads, which share K/V, instead of one head's
    # queries: K/V read once per group (forward, dQ) and bigger products per K/V tile (dK/dV).
    pack_gqa: bool = False

    def __post_init__(self) -> None:
        for name in ("one_loop", "pack_gqa"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"FlashConfig: {name} must be a bool, got {getattr(self, name)!r}")
        for name in ("block_m", "block_n", "num_warps", "num_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"FlashConfig: {name} must be an int >= 1, got {value!r}")
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"FlashConfig: {name} must be a power of two >= 16, got {value}")


@dataclasses.dataclass(frozen=True)
class KernelConfigs:
    """The three launches of one attention call: forward, dK/dV (block_m = keys) and dQ (block_m = queries)."""

    forward: FlashConfig
    kv: FlashConfig
    dq: FlashConfig


_C = FlashConfig
# widest head dim <= 64 / <= 128 / wider (MLA 192 is padded to 256 inside the kernels), then the longest
# document: <= 128 tokens (one tile), <= 1024, longer.
DIM_BUCKETS = (64, 128, 256)
LENGTH_BUCKETS = (128, 1024, None)
_TABLE: dict[tuple[int, int | None], KernelConfigs] = {
    (64, 128): KernelConfigs(_C(64, 64, 4, 2), _C(128, 32, 8, 3), _C(64, 64, 4, 2)),
    (64, 1024): KernelConfigs(_C(128, 64, 4, 3), _C(128, 32, 8, 3), _C(128, 64, 8, 2)),
    (64, None): KernelConfigs(_C(128, 64, 4, 3), _C(128, 32, 8, 3), _C(128, 64, 8, 2)),
    (128, 128): KernelConfigs(_C(64, 64, 4, 2), _C(128, 32, 8, 3), _C(128, 64, 8, 2)),
    (128, 1024): KernelConfigs(_C(128, 64, 8, 3), _C(64, 32, 8, 3), _C(128, 64, 8, 2)),
    (128, None): KernelConfigs(_C(128, 64, 8, 3), _C(64, 32, 8, 3), _C(128, 64, 8, 2)),
    (256, 128): KernelConfigs(_C(64, 32, 4, 2), _C(64, 32, 4, 1), _C(64, 32, 4, 1)),
    (256, 1024): KernelConfigs(_C(128, 32, 8, 2), _C(64, 32, 8, 1), _C(64, 32, 8, 1)),
    (256, None): KernelConfigs(_C(128, 32, 8, 2), _C(64, 32, 8, 1), _C(64, 32, 8, 1)),
}
_INTERPRETER = KernelConfigs(_C(16, 16, 1, 1), _C(16, 16, 1, 1), _C(16, 16, 1, 1))
# Where the table's values were measured (filled from the sweep's JSON when it is run).
MEASURED = "defaults before the 2026-12-01 sweep: FA2/Triton-tutorial tile shapes, not yet measured"


def _bucket(value: int, buckets: tuple) -> int | None:
    for bound in buckets:
        if bound is None or value <= bound:
            return bound
    return buckets[-1]


@functools.lru_cache(maxsize=256)
def longest_segment(layout: AttentionLayout) -> int:
    """The longest key segment of any pair: what the length buckets are keyed by."""
    return max((pair[5] for pair in layout.pairs), default=0)


@functools.cache
def kernel_configs(head_dim_qk: int, head_dim_v: int, longest: int, interpreting: bool) -> KernelConfigs:
    """The table's entry for these head dims and this longest document (the interpreter's tiny tiles in tests)."""
    if interpreting:
        return _INTERPRETER
    dim = _bucket(max(head_dim_qk, head_dim_v), DIM_BUCKETS)
    return _TABLE[(dim, _bucket(longest, LENGTH_BUCKETS))]


def gqa_pack(config: FlashConfig, group: int, tile_rows: int) -> int:
    """How many query heads of a GQA group share a tile's rows: the group if ``pack_gqa`` and it divides the tile
    (a power of two), else 1 (a tile per head)."""
    if config.pack_gqa and group > 1 and not group & (group - 1) and tile_rows % group == 0:
        return group
    return 1


@functools.lru_cache(maxsize=256)
def fused_dq_possible(layout: AttentionLayout, key_block: int) -> bool:
    """Whether the dK/dV kernel can write dQ itself: every query segment is paired with exactly one key
    segment, that segment is the same document (same start, length and positions: every query then sees at
    least itself) and it fits in one key block of ``key_block`` rows."""
    seen = set()
    for row, q_start, q_len, q_pos, k_start, k_len, k_pos in layout.pairs:
        if (q_start, q_len, q_pos) != (k_start, k_len, k_pos) or k_len > key_block or (row, q_start) in seen:
            return False
        seen.add((row, q_start))
    return layout.q_len == layout.k_len
