"""The weight-gradient GEMM into DDP's fp32 ``main_grad``: how each way of writing it costs, at the 8b4l linears.

``dW = grad^T @ x`` (``grad [tokens, out]``, ``x [tokens, in]``, bf16) timed on CUDA events:

* ``bf16``: ``torch.mm`` writing bf16 (no fusion: DDP's hook then adds it into fp32 ``main_grad``: an extra pass);
* ``add_fp32``: ``torch.addmm(main_grad, ..., out_dtype=float32)`` (gradient-accumulation fusion: reads and
  writes the fp32 buffer; a step's later micro-batches);
* ``write_fp32``: ``tensor_parallel.write_weight_grad_`` (``mm(out_dtype=float32)``, beta 0: the buffer is not
  read; a step's first weight gradient, whose region DDP then does not zero-fill), and its two forms apart:
  ``write_mm`` (``mm(out_dtype=float32)``) and ``write_addmm0`` (``addmm(beta=0, out_dtype=float32)``);
* ``fill_fp32``: the zero fill of the same fp32 region that ``write_fp32`` makes unnecessary (``Tensor.zero_``).

Writes ``OUT/wgrad_gemm.json`` and ``.md`` (ms and TFLOP/s per shape, sums over the step's linears)::

    python benchmarks/wgrad_gemm.py --out $OUT/wgrad        # one GPU, ~20 s
    python benchmarks/wgrad_gemm.py --dry-run --out /tmp/w  # CPU, tiny shapes (checks the ways agree)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
from _common import markdown_table, write_json

# the 8b4l linears (Llama-3-8B layer, 4 layers, vocab 128256) at seq 4096 x micro-batch 2: (name, out, in, count)
LINEARS_8B4L = (
    ("qkv", 6144, 4096, 4),
    ("proj", 4096, 4096, 4),
    ("gate_up", 28672, 4096, 4),
    ("down", 4096, 14336, 4),
    ("output", 128256, 4096, 1),
)
TOKENS_8B4L = 8192
TINY = (("a", 96, 64, 2), ("b", 64, 160, 1))
WAYS = ("bf16", "add_fp32", "write_fp32", "write_mm", "write_addmm0", "fill_fp32")


def cuda_ms(fn, iters: int, warmup: int) -> float:
    """Median milliseconds of ``fn`` over ``iters`` CUDA-event-timed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def one_linear(device, dtype, name: str, out_f: int, in_f: int, count: int, tokens: int, iters: int, warmup: int):
    """One linear's row: the ways checked against an fp32 GEMM, then (CUDA) timed."""
    from mcore.parallel.tensor_parallel import accumulate_weight_grad_, write_weight_grad_

    g = torch.Generator(device=device).manual_seed(0)
    grad = torch.randn(tokens, out_f, device=device, dtype=dtype, generator=g)
    x = torch.randn(tokens, in_f, device=device, dtype=dtype, generator=g)
    main = torch.zeros(out_f, in_f, device=device, dtype=torch.float32)
    # written over NaN (not read) and added onto zeros: both are the fp32 GEMM
    accumulate_weight_grad_(main, grad, x)
    added = main.clone()
    main.fill_(float("nan"))
    write_weight_grad_(main, grad, x)
    ref = grad.t().float().mm(x.float())
    err = max(float((t - ref).abs().max() / ref.abs().max()) for t in (added, main))
    row: dict[str, Any] = {"linear": name, "out": out_f, "in": in_f, "count": count, "max_rel_err": err}
    if device.type != "cuda":
        return row  # CPU: checked, not timed (the numbers would mean nothing)
    ways = {
        "bf16": lambda: grad.t().mm(x),
        "add_fp32": lambda: accumulate_weight_grad_(main, grad, x),
        "write_fp32": lambda: write_weight_grad_(main, grad, x),
        # the two beta-0 forms write_weight_grad_ can take (it uses the first that this torch accepts)
        "write_mm": lambda: torch.mm(grad.t(), x, out_dtype=torch.float32, out=main),
        "write_addmm0": lambda: torch.addmm(main, grad.t(), x, beta=0, out_dtype=torch.float32, out=main),
        "fill_fp32": lambda: main.zero_(),
    }
    flops = 2 * tokens * out_f * in_f
    for way, fn in ways.items():
        row[f"{way}_ms"] = ms = cuda_ms(fn, iters, warmup)
        if way != "fill_fp32":
            row[f"{way}_tflops"] = flops / ms / 1e9
    return row


def measure(device: torch.device, linears, tokens: int, iters: int, warmup: int) -> dict[str, Any]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = [one_linear(device, dtype, *lin, tokens, iters, warmup) for lin in linears]
    out: dict[str, Any] = {"tokens": tokens, "rows": rows}
    if device.type == "cuda":
        for way in WAYS:
            out[f"step_{way}_ms"] = sum(r[f"{way}_ms"] * r["count"] for r in rows)
    return out


def render(data: dict[str, Any]) -> str:
    lines = [f"# Weight-gradient GEMM into fp32 main_grad ({data['device']}, torch {data['torch']})", ""]
    res = data["result"]
    if "step_bf16_ms" not in res:
        return "\n".join(lines + ["CPU dry run: nothing timed.", ""])
    header = ["linear", "out x in", "x/step", "bf16 ms", "add fp32 ms", "write fp32 ms", "mm ms", "addmm beta 0 ms",
              "fill ms", "max rel err"]  # fmt: skip
    timed = lambda r, w: f"{r[w + '_ms']:.3f} ({r[w + '_tflops']:.0f})"  # noqa: E731
    body = [
        [r["linear"], f"{r['out']} x {r['in']}", r["count"], timed(r, "bf16"), timed(r, "add_fp32"),
         timed(r, "write_fp32"), timed(r, "write_mm"), timed(r, "write_addmm0"), f"{r['fill_fp32_ms']:.3f}",
         f"{r['max_rel_err']:.1e}"]
        for r in res["rows"]
    ]  # fmt: skip
    body.append(["step", "", "", *(f"{res[f'step_{w}_ms']:.2f}" for w in WAYS), ""])
    lines += [markdown_table(header, body), "", f"tokens per GEMM: {res['tokens']}; (TFLOP/s) beside the ms", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, not timed")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args(argv)
    device = torch.device("cpu" if args.dry_run else "cuda")
    if not args.dry_run and not torch.cuda.is_available():
        ap.error("no CUDA device: run with --dry-run on CPU")
    linears, tokens = (TINY, 48) if args.dry_run else (LINEARS_8B4L, TOKENS_8B4L)
    data = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "result": measure(device, linears, tokens, args.iters, args.warmup),
    }
    bad = [r["linear"] for r in data["result"]["rows"] if r["max_rel_err"] > 1e-2]
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "wgrad_gemm.json", data)
    (args.out / "wgrad_gemm.md").write_text(render(data))
    print(render(data))
    if bad:
        print(f"wgrad_gemm: the ways disagree on {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
