"""Which scale layouts and fp8 dtypes torch's block-scaled ``scaled_mm`` accepts on the GPU at hand.

torch's error message lists the rules only in words ("outer-dim-major", "near-inner-dim-major with 16-byte aligned
strides"); this probe tries every combination of operand dtypes (e4m3 / e5m2), scale recipes (1x128, 128x128) and
scale memory layouts (row-major, column-major, column-major with the leading stride padded to 4 floats) for
``a [M, K] @ b [K, N]`` and checks each accepted one against the dequantized fp32 product. Output: one JSON line
per combination (accepted, relative error, TFLOP/s at 8192^3) in ``--out``.

    python benchmarks/scaled_mm_layouts.py --out $OUT/scaled_mm_layouts.json
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch


def block_scales(x: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 scales of ``x`` per ``rows x cols`` block (amax / 448) and x divided by them (for e4m3 or e5m2)."""
    m, k = x.shape
    blocks = x.float().reshape(m // rows, rows, k // cols, cols)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    return scale, (blocks / scale[:, None, :, None]).reshape(m, k)


def layout(scale: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "row_major":
        return scale.contiguous()
    if kind == "col_major":
        return scale.t().contiguous().t()
    # column-major with the leading dimension padded to a multiple of 4 floats (16 bytes)
    rows, cols = scale.shape
    pad = (rows + 3) // 4 * 4
    buf = torch.zeros(cols, pad, device=scale.device, dtype=scale.dtype)
    buf[:, :rows] = scale.t()
    return buf[:, :rows].t()


def main() -> None:
    from torch.nn.functional import ScalingType, scaled_mm

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--size", type=int, default=8192)
    args = ap.parse_args()
    m = n = k = args.size
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(m, k, device="cuda", generator=gen)
    b = torch.randn(n, k, device="cuda", generator=gen)
    recipes = {"1x128": (1, 128, ScalingType.BlockWise1x128), "128x128": (128, 128, ScalingType.BlockWise128x128)}
    dtypes = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
    kinds = ("row_major", "col_major", "col_major_pad16")
    rows = []
    for (ra, rb), (da, db), (la, lb) in itertools.product(
        itertools.product(recipes, repeat=2), itertools.product(dtypes, repeat=2), itertools.product(kinds, repeat=2)
    ):
        sa, qa = block_scales(a, *recipes[ra][:2])
        sb, qb = block_scales(b, *recipes[rb][:2])  # b is [N, K]: blocks over (N, K)
        fa, fb = qa.to(dtypes[da]), qb.to(dtypes[db])
        ref = (fa.float() * sa.repeat_interleave(recipes[ra][0], 0).repeat_interleave(128, 1)) @ (
            fb.float() * sb.repeat_interleave(recipes[rb][0], 0).repeat_interleave(128, 1)
        ).t()
        # scale_b is given as [K/128, N/rows_b]: the transpose of b's [N/rows_b, K/128]
        scale_a, scale_b = layout(sa, la), layout(sb.t().contiguous(), lb)
        row = {"a": ra, "b": rb, "dtype_a": da, "dtype_b": db, "layout_a": la, "layout_b": lb}
        try:
            out = scaled_mm(fa, fb.t(), scale_a, recipes[ra][2], scale_b, recipes[rb][2], output_dtype=torch.bfloat16)
            torch.cuda.synchronize()
            row["accepted"] = True
            row["rel_err"] = float((out.float() - ref).norm() / ref.norm())
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                scaled_mm(fa, fb.t(), scale_a, recipes[ra][2], scale_b, recipes[rb][2], output_dtype=torch.bfloat16)
            end.record()
            torch.cuda.synchronize()
            row["tflops"] = 2 * m * n * k * 10 / (start.elapsed_time(end) * 1e-3) / 1e12
        except Exception as exc:  # noqa: BLE001 - the probe records what torch refuses
            row["accepted"] = False
            row["error"] = str(exc).splitlines()[0][:200]
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump({"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
