# ruff: noqa  (a device call's one-off measurement script, kept as run beside its results)
"""The mixtral2l expert casts timed per launch shape: the weights' row-and-column amax + dual cast
(``quantize_expert_weights_dual``, AMAX_TILE / CAST_TILE candidates) and the jagged column amax of the weight
gradient's operands (JAGGED_AMAX_TILE candidates), with GB/s of the bytes each must move."""

import json
import sys

import torch

from mcore.kernels.fp8_grouped_gemm import quantize_expert_weights_dual
from mcore.kernels.triton import quant_fused as qf
from mcore.kernels.triton import quantization as tq

dev = "cuda"
experts, hidden, ffn, rows = 8, 4096, 14336, 16384
offsets = torch.arange(1, experts + 1, device=dev, dtype=torch.int32) * (rows // experts)


def ms(fn, iters=10):
    for _ in range(3):
        fn()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters):
        fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / iters


out = {}
weights = {"gate_up": (2 * ffn, hidden), "down": (hidden, ffn)}
for name, (n, k) in weights.items():
    w = torch.randn(experts, n, k, device=dev, dtype=torch.bfloat16) * 0.02
    ideal = w.numel() * (2 + 2 + 1 + 1)  # amax pass read + cast pass read + two fp8 writes
    for const in ("AMAX_TILE", "CAST_TILE"):
        saved = getattr(qf, const)
        extra = {"AMAX_TILE": ((256, 32, 256, 8), (512, 32, 256, 8), (256, 16, 512, 8), (1024, 32, 256, 8))}
        for tile in qf.TILE_CANDIDATES[const] + extra.get(const, ()):
            setattr(qf, const, tile)
            try:
                t = ms(lambda: quantize_expert_weights_dual(w, "scaled_grouped_mm"))
                row = (t, ideal / t / 1e6)
            except Exception as exc:
                row = (str(exc)[:100], None)
            out[f"weights {name} {const} {'x'.join(map(str, tile))}"] = row
            print(
                f"weights {name:8s} {const} {tile}: {row[0] if isinstance(row[0], str) else f'{row[0]:.3f} ms {row[1]:.0f} GB/s'}"
            )
        setattr(qf, const, saved)
    del w
jagged = (
    (32, 128, 4),
    (64, 128, 4),
    (64, 128, 8),
    (128, 128, 8),
    (32, 256, 4),
    (64, 256, 8),
    (16, 128, 4),
    (32, 64, 4),
    (16, 64, 2),
    (128, 64, 4),
)
for name, cols in (("dy gate_up", 2 * ffn), ("x down (h)", ffn), ("x gate_up", hidden)):
    x = torch.randn(rows, cols, device=dev, dtype=torch.bfloat16)
    saved = tq.JAGGED_AMAX_TILE
    for tile in jagged:
        tq.JAGGED_AMAX_TILE = tile
        try:
            t = ms(lambda: tq.jagged_column_amax(x, offsets))
            row = (t, x.numel() * 2 / t / 1e6)
        except Exception as exc:
            row = (str(exc)[:100], None)
        out[f"jagged {name} {'x'.join(map(str, tile))}"] = row
        print(
            f"jagged {name:10s} {tile}: {row[0] if isinstance(row[0], str) else f'{row[0]:.3f} ms {row[1]:.0f} GB/s'}"
        )
    tq.JAGGED_AMAX_TILE = saved
    copy = torch.empty_like(x)
    t = ms(lambda: copy.copy_(x))
    print(f"copy {name}: {t:.3f} ms {x.numel() * 4 / t / 1e6:.0f} GB/s (read + write)")
    out[f"copy {name}"] = (t, x.numel() * 4 / t / 1e6)
json.dump(out, open(sys.argv[1], "w"), indent=1)
