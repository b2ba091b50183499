"""Attention on packed documents: our Triton flash attention beside SDPA, compiled FlexAttention and torch's
``varlen_attn``, forward and backward apart, with a correctness check of ours in the same run.

Cases (issue #18): 16,384 tokens per call as 1 x 16384, 4 x 4096, 32 x 512 and 128 x 128 causal documents,
Hq 32, Hkv 8, D 128, bf16; plus GPT-OSS-like sinks with a 128-token window and MLA's 192/128 head dims.
Effective TFLOP/s count the issue's way: forward ``4 * L^2 / 2 * H * D`` per document of length L, backward
2.5x that, forward + backward 3.5x. SDPA runs only where the case is one plain document; ``varlen_attn``
gets K/V repeated to Hq heads outside the timed region when its torch lacks ``enable_gqa``.

FlexAttention is timed as the issue measured it: compiled once, its block mask built once, both outside the timed
call. ``auto`` is the op's own choice of backend (``mcore.kernels.attention`` logs which and why).

Correctness: ours against SDPA (one document) or compiled FlexAttention (documents) on the same inputs:
relative L2 error of the output and of dQ, dK, dV (and the sinks' gradient), which must stay under 2e-2.
``--sweep`` (``--only-sweep``: without the comparison table) first times our kernels one by one at candidate tile
configurations (``attention_sweep.py``; the defaults in ``mcore.kernels.triton.flash_configs`` come from it).
JSON goes to ``--out`` (``$OUT`` on the device) after every case, so a run cut short keeps what finished.
``--dry-run`` runs the same path on the CPU with tiny shapes (ours under ``TRITON_INTERPRET=1``).

    python benchmarks/attention.py --out $OUT --only-sweep   # one H200: about 3 minutes
    python benchmarks/attention.py --out $OUT                # the comparison table: about 3 minutes
    python benchmarks/attention.py --dry-run --sweep --out /tmp/attn
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import inspect
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

if "--dry-run" in sys.argv:  # read by triton when our kernels are first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

GPU_CASES = [  # name, documents, length, extra keyword arguments, q/k head dim, v head dim
    ("1x16384", 1, 16384, {}, 128, 128),
    ("4x4096", 4, 4096, {}, 128, 128),
    ("32x512", 32, 512, {}, 128, 128),
    ("128x128", 128, 128, {}, 128, 128),
    ("4x4096 sinks window128", 4, 4096, {"sinks": True, "window_size": 128}, 128, 128),
    ("1x16384 mla 192/128", 1, 16384, {}, 192, 128),
]
DRY_CASES = [
    ("1x48", 1, 48, {}, 16, 16),
    ("2x32 sinks window8", 2, 32, {"sinks": True, "window_size": 8}, 16, 16),
    ("4x16 mla 24/16", 4, 16, {}, 24, 16),
]
CHECK_TOLERANCE = 2e-2


@dataclasses.dataclass
class Shape:
    heads: int
    kv_heads: int
    dtype: torch.dtype
    device: str


def fwd_flops(docs: int, length: int, heads: int, head_dim_qk: int, head_dim_v: int, window: int | None) -> float:
    """The issue's count: 2 FLOPs per multiply-add over half the square (QK^T at Dqk, PV at Dv), per document."""
    pairs = length * length / 2 if window is None else sum(min(i + 1, window) for i in range(length))
    return 2.0 * docs * pairs * heads * (head_dim_qk + head_dim_v)


def _time_ms(fn: Callable[[], object], device: str, reps: int) -> float:
    if device == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=10, rep=max(reps * 5, 50), return_mode="median"))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _inputs(docs: int, length: int, shape: Shape, d_qk: int, d_v: int, with_sinks: bool):
    tokens = docs * length
    make = lambda h, d: torch.randn(1, tokens, h, d, device=shape.device, dtype=shape.dtype)  # noqa: E731
    q, k, v = make(shape.heads, d_qk), make(shape.kv_heads, d_qk), make(shape.kv_heads, d_v)
    sinks = torch.randn(shape.heads, device=shape.device) if with_sinks else None
    cu = torch.arange(0, tokens + 1, length, dtype=torch.int32)  # on the CPU: no device sync
    return q, k, v, sinks, cu


def _impls(docs: int, length: int, kwargs: dict, cu: torch.Tensor, shape: Shape, d_qk: int, d_v: int, atomic: bool):
    """name -> fn(q, k, v, sinks) for every implementation that can express the case."""
    from mcore.kernels import attention

    window = kwargs.get("window_size")
    doc_kwargs = {} if docs == 1 else {"cu_seqlens": cu}
    impls = {
        # the op's own choice (the dispatcher's log line says which backend and why)
        "auto": lambda q, k, v, s: attention(q, k, v, sinks=s, window_size=window, **doc_kwargs),
        "ours": lambda q, k, v, s: attention(q, k, v, sinks=s, window_size=window, backend="triton", **doc_kwargs),
    }
    if atomic:
        impls["ours-atomic-dq"] = lambda q, k, v, s: attention(
            q, k, v, sinks=s, window_size=window, backend="triton", deterministic=False, **doc_kwargs
        )
    if docs == 1 and "sinks" not in kwargs and window is None:
        impls["sdpa"] = lambda q, k, v, s: attention(q, k, v, backend="sdpa")
    impls["flex"] = _flex_prebuilt(docs, length, window, cu, shape)
    if shape.device != "cuda":  # the dry run's check reference: torch's flex has no CPU backward
        impls["reference"] = lambda q, k, v, s: attention(
            q, k, v, sinks=s, window_size=window, backend="reference", **doc_kwargs
        )
    varlen = _varlen(cu, length, window, shape) if "sinks" not in kwargs else None
    if varlen is not None:
        impls["varlen_attn"] = varlen
    return impls


def _flex_prebuilt(docs: int, length: int, window: int | None, cu: torch.Tensor, shape: Shape):
    """Compiled FlexAttention as the issue timed it: the block mask built once and the kernel compiled once,
    both outside the timed call (mcore's ``flex`` backend builds the mask per call)."""
    from torch.nn.attention import flex_attention as flex

    from mcore.kernels.attention_torch import _document_ids, _flex_block_mask, _flex_kernel

    tokens, device = docs * length, torch.device(shape.device)
    bounds = None if docs == 1 else cu.tolist()
    doc_ids = None if docs == 1 else _document_ids(cu.to(device), 1, tokens)
    block_mask = _flex_block_mask(1, tokens, True, window, bounds, doc_ids, device)
    kernel = _flex_kernel(shape.device)

    def run(q, k, v, s):
        args = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        kwargs = dict(block_mask=block_mask, scale=q.shape[-1] ** -0.5, enable_gqa=q.shape[2] != k.shape[2])
        if s is None:
            return kernel(*args, **kwargs).transpose(1, 2)
        out, aux = kernel(*args, **kwargs, return_aux=flex.AuxRequest(lse=True))
        # softmax over [scores, sink] without the sink column = softmax(scores) * Z / (Z + e^sink)
        keep = torch.sigmoid(aux.lse.float() - s.float()[None, :, None])
        return (out.float() * keep[..., None]).to(q.dtype).transpose(1, 2)

    return run


def _varlen(cu: torch.Tensor, length: int, window: int | None, shape: Shape):
    if shape.device != "cuda":
        return None
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    cu_dev = cu.to(shape.device)
    extra = {}
    if "is_causal" in params:
        extra["is_causal"] = True
        if window is not None:
            return None
    else:
        extra["window_size"] = (-1 if window is None else window - 1, 0)
    gqa = "enable_gqa" in params
    if gqa:
        extra["enable_gqa"] = True

    def prepare(k, v):
        group = shape.heads // shape.kv_heads
        if gqa or group == 1:
            return k[0], v[0]
        return k[0].repeat_interleave(group, dim=1), v[0].repeat_interleave(group, dim=1)

    def run(q, k, v, s, prepared=None):
        key, value = prepared if prepared is not None else prepare(k, v)
        return varlen_attn(q[0], key, value, cu_dev, cu_dev, length, length, **extra)[None]

    run.prepare = prepare
    return run


def _check(ours, ref) -> dict[str, float]:
    """Relative L2 errors of ours against a reference implementation: output and every gradient."""
    out_a, grads_a = ours
    out_b, grads_b = ref
    rel = lambda a, b: float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))  # noqa: E731
    errors = {"out": rel(out_a, out_b)}
    for name, ga, gb in zip(["dq", "dk", "dv", "dsinks"], grads_a, grads_b):
        errors[name] = rel(ga, gb)
    return errors


def _measure(fn, tensors, grad_out, flops, shape: Shape, reps: int, forward_only: bool):
    """Forward time, backward time (``retain_graph``: the same graph replayed) and the output + gradients."""
    q, k, v, sinks = tensors
    leaves = [t.detach().requires_grad_(not forward_only) for t in (q, k, v)]
    s_leaf = sinks.detach().requires_grad_(not forward_only) if sinks is not None else None
    prepared = fn.prepare(*leaves[1:]) if hasattr(fn, "prepare") else None

    def call():
        return fn(*leaves, s_leaf) if prepared is None else fn(*leaves, s_leaf, prepared)

    row = {"fwd_ms": _time_ms(call, shape.device, reps)}
    row["fwd_tflops"] = flops / row["fwd_ms"] / 1e9
    if forward_only:
        return row, (call(), ())
    out = call()
    inputs = leaves + ([s_leaf] if s_leaf is not None else [])
    row["bwd_ms"] = _time_ms(lambda: torch.autograd.grad(out, inputs, grad_out, retain_graph=True), shape.device, reps)
    row["bwd_tflops"] = 2.5 * flops / row["bwd_ms"] / 1e9
    row["fwd_bwd_tflops"] = 3.5 * flops / (row["fwd_ms"] + row["bwd_ms"]) / 1e9
    return row, (out.detach(), torch.autograd.grad(out, inputs, grad_out))


def bench_case(case, shape: Shape, reps: int, atomic: bool = True) -> dict:
    name, docs, length, kwargs, d_qk, d_v = case
    q, k, v, sinks, cu = _inputs(docs, length, shape, d_qk, d_v, kwargs.get("sinks", False))
    flops = fwd_flops(docs, length, shape.heads, d_qk, d_v, kwargs.get("window_size"))
    result = {"case": name, "docs": docs, "length": length, "d_qk": d_qk, "d_v": d_v, "fwd_gflop": flops / 1e9}
    result["impls"] = {}
    grad_out = torch.randn(1, docs * length, shape.heads, d_v, device=shape.device, dtype=shape.dtype)
    impls = _impls(docs, length, kwargs, cu, shape, d_qk, d_v, atomic)
    outputs = {}
    for impl, fn in impls.items():
        # torch's flex has no CPU backward (and refuses inputs that require grad there): forward only.
        forward_only = shape.device != "cuda" and impl == "flex"
        try:
            row, outputs[impl] = _measure(fn, (q, k, v, sinks), grad_out, flops, shape, reps, forward_only)
        except Exception as exc:  # one implementation failing must not hide the others
            row = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            traceback.print_exc()
        result["impls"][impl] = row
        if shape.device == "cuda":
            torch.cuda.empty_cache()
    reference = next((name for name in ("sdpa", "flex", "reference") if outputs.get(name, (None, ()))[1]), None)
    if "ours" in outputs and reference in outputs:
        result["check"] = {"against": reference, **_check(outputs["ours"], outputs[reference])}
        result["check"]["ok"] = all(
            err < CHECK_TOLERANCE for key, err in result["check"].items() if key not in ("against", "ok")
        )
    return result


def markdown(report: dict) -> str:
    lines = [
        f"{report['device']}; torch {report['torch']}; triton {report['triton']}; {report['date']}",
        "",
        "| case | impl | fwd ms | fwd TFLOP/s | bwd ms | bwd TFLOP/s | fwd+bwd TFLOP/s |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    fmt = lambda x, d=1: "" if x is None else f"{x:.{d}f}"  # noqa: E731
    for case in report["cases"]:
        for impl, row in case["impls"].items():
            lines.append(
                f"| {case['case']} | {impl} | {fmt(row.get('fwd_ms'), 3)} | {fmt(row.get('fwd_tflops'))} | "
                f"{fmt(row.get('bwd_ms'), 3)} | {fmt(row.get('bwd_tflops'))} | {fmt(row.get('fwd_bwd_tflops'))} |"
                + (f" {row['error'][:80]}" if "error" in row else "")
            )
    return "\n".join(lines)


def _run_sweep(args, shape, cases, reps, report, out_dir: Path) -> None:
    import attention_sweep

    totals_only = set(args.totals_only.split(",")) if args.totals_only else set()
    if args.dry_run:
        sweep_cases = cases[:1] + [c for c in cases[1:] if c[0] in totals_only]
    else:
        sweep_cases = [c for name in attention_sweep.SWEEP_ORDER for c in cases if c[0] == name]
    if args.sweep_cases:
        sweep_cases = [c for c in sweep_cases if c[0] in set(args.sweep_cases.split(",")) | totals_only]
    jobs = args.jobs if args.jobs is not None else (0 if args.dry_run else 8)
    if jobs > 0:
        start = time.perf_counter()
        swept = [c for c in sweep_cases if c[0] not in totals_only]
        report["precompile_errors"] = attention_sweep.precompile(swept, shape, jobs, args.dry_run)
        report["precompile_s"] = round(time.perf_counter() - start, 1)
        print(f"precompiled in {report['precompile_s']} s; errors: {report['precompile_errors']}", flush=True)
    flops = {c[0]: fwd_flops(c[1], c[2], shape.heads, c[4], c[5], c[3].get("window_size")) for c in cases}
    for case in sweep_cases:
        start = time.perf_counter()
        rows = attention_sweep.sweep_case(
            case, shape, lambda fn: _time_ms(fn, shape.device, reps), args.dry_run, case[0] in totals_only
        )
        report["sweep"].extend(rows)
        (out_dir / "attention.json").write_text(json.dumps(report, indent=1))
        table = attention_sweep.markdown(report["sweep"], flops)
        (out_dir / "attention_sweep.md").write_text(table + "\n")
        print(attention_sweep.markdown(rows, flops), f"\n({case[0]}: {time.perf_counter() - start:.1f} s)", flush=True)
        if shape.device == "cuda":
            torch.cuda.empty_cache()
        if args.use_swept and case[0] not in totals_only:
            report.setdefault("swept_defaults", {})[case[0]] = _install_best(rows, case)


def _install_best(rows: list[dict], case) -> dict | None:
    """Make the sweep's fastest checked tiles of ``case`` the table entry of its bucket for the comparison that
    follows (so that "ours" and "auto" run them); returns them, or None when a kernel had no checked row."""
    import attention_sweep

    from mcore.kernels.triton.flash_configs import FlashConfig, KernelConfigs, set_entry

    best = attention_sweep.best_configs(rows, case[0])
    if not {"fwd", "kv", "dq"} <= set(best):
        return None
    chosen = {kind: best[kind]["config"] for kind in ("fwd", "kv", "dq")}
    window = case[3].get("window_size")
    longest = case[2] if window is None else min(case[2], window)  # the table's key: the longest visible span
    set_entry(case[4], case[5], longest, KernelConfigs(*(FlashConfig(*chosen[k]) for k in ("fwd", "kv", "dq"))))
    return chosen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for attention.json / .md")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, ours under the interpreter")
    parser.add_argument("--sweep", action="store_true", help="first time our kernels at candidate tile configs")
    parser.add_argument("--only-sweep", action="store_true", help="the sweep without the comparison table")
    parser.add_argument(
        "--jobs", type=int, default=None, help="processes compiling the sweep's kernels first (8; dry run: 0)"
    )
    parser.add_argument("--cases", default=None, help="comma-separated case names to run (default: all)")
    parser.add_argument("--sweep-cases", default=None, help="comma-separated cases to sweep (default: all run)")
    parser.add_argument(
        "--totals-only", default=None, help="comma-separated cases of the sweep timed at the defaults only"
    )
    parser.add_argument(
        "--use-swept", action="store_true", help="the comparison runs each swept case at the sweep's fastest tiles"
    )
    parser.add_argument("--no-atomic", action="store_true", help="leave out the atomic-dQ variant of ours")
    parser.add_argument("--reps", type=int, default=None)
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("benchmarks/attention.py needs a CUDA GPU (or --dry-run); nothing was measured.", file=sys.stderr)
        return 2
    import triton

    torch.manual_seed(0)
    if args.dry_run:
        shape, cases, reps = Shape(4, 2, torch.float32, "cpu"), DRY_CASES, args.reps or 1
    else:
        shape, cases, reps = Shape(32, 8, torch.bfloat16, "cuda"), GPU_CASES, args.reps or 10
    if args.cases:
        wanted = [name.strip() for name in args.cases.split(",")]
        unknown = sorted(set(wanted) - {c[0] for c in cases})
        if unknown:
            print(f"--cases: unknown {unknown}; known: {[c[0] for c in cases]}", file=sys.stderr)
            return 2
        cases = [c for c in cases if c[0] in wanted]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {
        "device": torch.cuda.get_device_name() if shape.device == "cuda" else "cpu (dry run)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "heads": shape.heads,
        "kv_heads": shape.kv_heads,
        "dtype": str(shape.dtype),
        "cases": [],
        "sweep": [],
    }
    ok = True
    if args.sweep or args.only_sweep:
        _run_sweep(args, shape, cases, reps, report, out_dir)
        ok = all(row.get("ok", False) for row in report["sweep"] if row["kernel"].startswith("total"))
    for case in [] if args.only_sweep else cases:
        result = bench_case(case, shape, reps, atomic=not args.no_atomic)
        report["cases"].append(result)
        ok &= result.get("check", {}).get("ok", False)
        (out_dir / "attention.json").write_text(json.dumps(report, indent=1))
        (out_dir / "attention.md").write_text(markdown(report) + "\n")
        print("\n".join(markdown({**report, "cases": [result]}).splitlines()[4:]), flush=True)
    if report["cases"]:
        print(markdown(report))
        print("correctness:", "ok" if ok else "FAILED", [c.get("check") for c in report["cases"]])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
