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
measurements they come from are in the comment above the table.
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
# widest head dim <= 64 / <= 128 / wider (MLA 192 is padded to 256 inside the kernels), then the longest key
# span a query can see (the longest document, or the window if shorter): <= 128 tokens (one tile), <= 1024, longer.
DIM_BUCKETS = (64, 128, 256)
LENGTH_BUCKETS = (128, 1024, None)
# Measured: H200, Triton 3.6, torch 2.11, bf16, Hq 32, Hkv 8, 16,384 tokens per call, each kernel alone
# (``benchmarks/attention.py --only-sweep`` at commit 5be4d1b, 2026-12-01; the JSON is in
# benchmarks/results/attention-sweep-h200-2026-12-01):
#
#   case (bucket)          forward (m, n, warps, stages)  dK/dV (keys, queries, ...)          dQ
#   128 x 128  (128, 128)  (64, 64, 4, 3)   0.178 ms      (128, 32, 8, 3) 0.405, stores dQ     -
#              others      (128,128,8,3) 0.236 (64,64,4,2) 0.181  (32,64,4,3) 0.365 + dQ 0.224 (64,32,4,3)
#   32 x 512   (128, 1024) (64, 64, 4, 3)   0.272         (128, 32, 8, 3) 0.573               (64, 32, 4, 3) 0.347
#              others      (128,128,8,3) 0.319            (64,64,8,3) 0.875, (32,64,4,3) 0.778  (128,32,4,3) 0.366
#   4 x 4096   (128, None) (128, 128, 8, 3) 1.234         (128, 32, 8, 3) 3.129               (128, 64, 8, 3) 1.518
#   1 x 16384  (128, None) (128, 128, 8, 3) 4.488         (128, 32, 8, 3) 11.92               (128, 64, 8, 3) 5.588
#              others      (128,64,8,3) 4.588             (64,64,8,3) 19.9, old (64,64,8,2) 19.3  old 6.558
#   window 128 (128, 128)  (64, 64, 4, 3)   0.223         (128, 32, 8, 3) 0.508               (128, 32, 8, 3) 0.372
#   MLA 1x16k  (256, None) (128, 64, 8, 2)  7.253         (64, 32, 8, 2) 31.32                (128, 32, 8, 2) 12.75
#
# dK/dV with 128 keys spills registers on sm90 (ptxas) and is still the fastest everywhere: half the Q/dO reloads
# of 64 keys. dQ by fp32 atomics in the dK/dV kernel: 70-76 ms on 1 x 16384 (vs 5.6 ms for the dQ kernel).
# Head dim 64 and MLA's shorter buckets are not measured: they follow the nearest measured choice.
#
# Short documents re-swept (branch flash at 2884fd8, 2026-12-01 15:12, the kernels computing delta/lse2 in place
# of the preprocess pass; benchmarks/results/attention-short-h200-2026-12-01-s3, ms of each kernel alone):
#
#   128 x 128  forward (64, 32, 4, 3) 0.149 (64,64,4,3 0.176; 64,64,4,1 0.168; 128-row tiles 0.24-0.25)
#              dK/dV (128, 32, 8, 2, packed GQA) 0.418 stores dQ (128,32,8,3 0.435; 128,64,8,2 0.421; 4 or 16
#              warps 0.82-1.43); dQ (64, 32, 4, 3) 0.266 (only with 64-key dK/dV blocks: 0.233 + 0.266)
#   32 x 512   forward (64, 32, 4, 3) 0.269 (64,64,4,3 0.273); dK/dV (64, 32, 4, 2) 0.534 (128,32,8,3 0.557);
#              dQ (64, 32, 4, 3) 0.396
#   totals (fwd + bwd ms, the TFLOP/s): 128 x 128 0.149 + 0.418, 106 (last tiles 0.176 + 0.435, 98; with
#   the preprocess pass 0.149 + 0.450, 100); 32 x 512 0.264 + 0.944, 199 (last tiles 195; preprocess 194).
#   A dK/dV variant holding the key block as two halves (the second skipped above the diagonal) ran 2x slower
#   (0.86 ms at 128 x 128: ptxas spills ~1 KB per thread) and was removed.
_TABLE: dict[tuple[int, int | None], KernelConfigs] = {
    (64, 128): KernelConfigs(_C(64, 32, 4, 3), _C(128, 32, 8, 2, pack_gqa=True), _C(64, 32, 4, 3)),
    (64, 1024): KernelConfigs(_C(64, 32, 4, 3), _C(64, 32, 4, 2), _C(64, 32, 4, 3)),
    (64, None): KernelConfigs(_C(128, 128, 8, 3), _C(128, 32, 8, 3), _C(128, 64, 8, 3)),
    (128, 128): KernelConfigs(_C(64, 32, 4, 3), _C(128, 32, 8, 2, pack_gqa=True), _C(64, 32, 4, 3)),
    (128, 1024): KernelConfigs(_C(64, 32, 4, 3), _C(64, 32, 4, 2), _C(64, 32, 4, 3)),
    (128, None): KernelConfigs(_C(128, 128, 8, 3), _C(128, 32, 8, 3), _C(128, 64, 8, 3)),
    (256, 128): KernelConfigs(_C(128, 64, 8, 2), _C(64, 32, 8, 2), _C(128, 32, 8, 2)),
    (256, 1024): KernelConfigs(_C(128, 64, 8, 2), _C(64, 32, 8, 2), _C(128, 32, 8, 2)),
    (256, None): KernelConfigs(_C(128, 64, 8, 2), _C(64, 32, 8, 2), _C(128, 32, 8, 2)),
}
_INTERPRETER = KernelConfigs(_C(16, 16, 1, 1), _C(16, 16, 1, 1), _C(16, 16, 1, 1))
MEASURED = "H200 sweeps at 5be4d1b and (short documents) 2884fd8, 2026-12-01 (table above)"


def _bucket(value: int, buckets: tuple) -> int | None:
    for bound in buckets:
        if bound is None or value <= bound:
            return bound
    return buckets[-1]


@functools.lru_cache(maxsize=256)
def longest_key_span(layout: AttentionLayout) -> int:
    """The longest key span a query of the layout can see: the longest key segment of any pair, or the window
    if it is shorter (a 128-token window over 4096-token documents runs best on the short-document tiles)."""
    longest = max((pair[5] for pair in layout.pairs), default=0)
    return longest if layout.window_size is None else min(longest, layout.window_size)


@functools.cache
def kernel_configs(head_dim_qk: int, head_dim_v: int, longest: int, interpreting: bool) -> KernelConfigs:
    """The table's entry for these head dims and this longest document (the interpreter's tiny tiles in tests)."""
    if interpreting:
        return _INTERPRETER
    dim = _bucket(max(head_dim_qk, head_dim_v), DIM_BUCKETS)
    return _TABLE[(dim, _bucket(longest, LENGTH_BUCKETS))]


def set_entry(head_dim_qk: int, head_dim_v: int, longest: int, configs: KernelConfigs) -> KernelConfigs:
    """Replace the table's entry for these head dims and this longest document (``benchmarks/attention.py`` runs
    its comparison with the tiles its sweep just measured fastest); returns the previous entry."""
    if not isinstance(configs, KernelConfigs):
        raise TypeError(f"set_entry: configs must be a KernelConfigs, got {type(configs).__name__}")
    key = (_bucket(max(head_dim_qk, head_dim_v), DIM_BUCKETS), _bucket(longest, LENGTH_BUCKETS))
    previous = _TABLE[key]
    _TABLE[key] = configs
    kernel_configs.cache_clear()
    return previous


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
