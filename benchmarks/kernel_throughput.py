"""Benchmark of the mcore.kernels ops on one CUDA GPU, against the ceilings measured in the same run.

For every op, forward and forward+backward, it times the Triton kernel, the eager torch reference and
``torch.compile`` of that reference (attention: SDPA, FlexAttention and the reference), with
``triton.testing.do_bench`` (median, L2 flushed between runs). Memory-bound ops report GB/s over the
minimal bytes (each input read once, each output written once) and the fraction of the measured copy
bandwidth; attention reports TFLOP/s over the FLOPs of the unmasked score pairs; cross entropy at Llama-3's
vocabulary also reports peak memory against ``F.cross_entropy(logits.float(), y)``.

The forward is timed with inputs that require grad (as in training: the graph is recorded). Usage::

    python benchmarks/kernel_throughput.py [--json results.json] [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class Row:
    op: str
    case: str
    mode: str  # "fwd" or "fwd+bwd"
    impl: str
    ms: float | None = None
    gbps: float | None = None
    pct_copy: float | None = None
    tflops: float | None = None
    peak_mb: float | None = None
    note: str = ""


@dataclass
class Report:
    device: str
    torch: str
    triton: str
    date: str
    commit: str
    ceilings: dict[str, float] = field(default_factory=dict)
    rows: list[Row] = field(default_factory=list)


def _bench_ms(fn: Callable[[], object], quick: bool) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=5 if quick else 25, rep=20 if quick else 100, return_mode="median"))


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def measure_ceilings(report: Report, quick: bool) -> None:
    n_bytes = 1 << 30
    src = torch.randn(n_bytes // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = _bench_ms(lambda: dst.copy_(src), quick)
    report.ceilings["copy_gbps"] = 2 * n_bytes / ms / 1e6
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = _bench_ms(lambda: a @ b, quick)
    report.ceilings["gemm_bf16_tflops"] = 2 * n**3 / ms / 1e9


def _grad_step(fn: Callable[[], object], inputs: list[torch.Tensor]) -> Callable[[], object]:
    """Forward then backward with a fixed random upstream gradient (torch.autograd.grad: no accumulation)."""
    probe = fn()
    outs = list(probe) if isinstance(probe, tuple | list) else [probe]
    grads = [torch.randn_like(o) for o in outs]
    del probe, outs

    def step():
        out = fn()
        out = list(out) if isinstance(out, tuple | list) else [out]
        return torch.autograd.grad(out, inputs, grads)

    return step


def _add_timed(
    report: Report,
    op: str,
    case: str,
    impls: dict[str, Callable[[], object]],
    inputs: list[torch.Tensor],
    bytes_fwd: float,
    bytes_bwd: float,
    flops_fwd: float | None,
    quick: bool,
) -> None:
    copy = report.ceilings["copy_gbps"]
    for impl, fn in impls.items():
        for mode in ("fwd", "fwd+bwd"):
            row = Row(op, case, mode, impl)
            try:
                run = fn if mode == "fwd" else _grad_step(fn, inputs)
                row.ms = _bench_ms(run, quick)
                n_bytes = bytes_fwd if mode == "fwd" else bytes_fwd + bytes_bwd
                if flops_fwd is None:
                    row.gbps = n_bytes / row.ms / 1e6
                    row.pct_copy = 100 * row.gbps / copy
                else:
                    # Backward of attention: 2.5x the forward's matmul FLOPs (dQ, dK, dV, and the recomputed P).
                    flops = flops_fwd if mode == "fwd" else 3.5 * flops_fwd
                    row.tflops = flops / row.ms / 1e9
            except Exception as exc:  # a failing variant is reported, not fatal
                row.note = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
            report.rows.append(row)
            torch.cuda.empty_cache()


def _three_way(op_fn: Callable[..., object], args: tuple, kwargs: dict) -> dict[str, Callable[[], object]]:
    compiled = torch.compile(lambda *a: op_fn(*a, backend="reference", **kwargs))
    return {
        "triton": lambda: op_fn(*args, backend="triton", **kwargs),
        "reference": lambda: op_fn(*args, backend="reference", **kwargs),
        "compiled reference": lambda: compiled(*args),
    }


def bench_elementwise(report: Report, quick: bool) -> None:
    import mcore.kernels as mk

    dt, el = torch.bfloat16, 2
    tokens, hidden = 8192, 4096
    x = torch.randn(tokens, hidden, device="cuda", dtype=dt, requires_grad=True)
    w = (1 + 0.1 * torch.randn(hidden, device="cuda", dtype=dt)).requires_grad_()
    bias = (0.1 * torch.randn(hidden, device="cuda", dtype=dt)).requires_grad_()
    nh = tokens * hidden * el
    # fwd: read x, write y; bwd: read x and dy, write dx (the weight-sized terms are negligible).
    _add_timed(
        report, "rms_norm", "8192x4096 bf16", _three_way(mk.rms_norm, (x, w), {}), [x, w], 2 * nh, 3 * nh, None, quick
    )
    _add_timed(
        report,
        "layer_norm",
        "8192x4096 bf16",
        _three_way(mk.layer_norm, (x, w, bias), {}),
        [x, w, bias],
        2 * nh,
        3 * nh,
        None,
        quick,
    )
    del x, w, bias

    s, b, hq, hk, d = 4096, 2, 32, 8, 128
    q = torch.randn(s, b, hq, d, device="cuda", dtype=dt, requires_grad=True)
    k = torch.randn(s, b, hk, d, device="cuda", dtype=dt, requires_grad=True)
    inv_freq, _ = mk.rope_inv_freq(d, 500000.0)
    cos, sin = mk.rope_cos_sin(inv_freq.cuda(), torch.arange(s, device="cuda")[:, None])  # [s, 1, d] fp32
    qk = (q.numel() + k.numel()) * el
    tables = 2 * cos.numel() * 4
    _add_timed(
        report,
        "apply_rotary",
        "q[4096,2,32,128] k[..,8,..] bf16",
        _three_way(mk.apply_rotary, (q, k, cos, sin), {}),
        [q, k],
        2 * qk + tables,
        2 * qk + tables,
        None,
        quick,
    )
    del q, k

    tokens, ffn = 8192, 14336
    x = torch.randn(tokens, 2 * ffn, device="cuda", dtype=dt, requires_grad=True)
    m = tokens * ffn * el
    # fwd: read [gate, up], write out; bwd: read [gate, up] and dout, write d[gate, up].
    _add_timed(report, "swiglu", "8192x(2*14336) bf16", _three_way(mk.swiglu, (x,), {}), [x], 3 * m, 5 * m, None, quick)
    _add_timed(report, "geglu", "8192x(2*14336) bf16", _three_way(mk.geglu, (x,), {}), [x], 3 * m, 5 * m, None, quick)


def _peak_mb(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def bench_cross_entropy(report: Report, quick: bool) -> None:
    from mcore.kernels import cross_entropy

    n, v = 8192, 128256
    logits = torch.randn(n, v, device="cuda", dtype=torch.bfloat16).mul_(3).requires_grad_()
    target = torch.randint(0, v, (n,), device="cuda")
    nv = n * v * 2
    case = "8192 x 128256 bf16"
    impls = _three_way(cross_entropy, (logits, target), {})
    impls["F.cross_entropy(fp32)"] = lambda: F.cross_entropy(logits.float(), target, reduction="none")
    # fwd: read the logits once; bwd: read them again and write the gradient.
    _add_timed(report, "cross_entropy", case, impls, [logits], nv, 2 * nv, None, quick)

    grad = torch.rand(n, device="cuda")
    memory_cases = {
        "triton": lambda: cross_entropy(logits, target, backend="triton"),
        "triton inplace_backward": lambda: cross_entropy(logits, target, backend="triton", inplace_backward=True),
        "reference": lambda: cross_entropy(logits, target, backend="reference"),
        "F.cross_entropy(fp32)": lambda: F.cross_entropy(logits.float(), target, reduction="none"),
    }
    for impl, fn in memory_cases.items():
        row = Row("cross_entropy", case, "fwd+bwd peak memory", impl)
        try:
            row.peak_mb = _peak_mb(lambda fn=fn: torch.autograd.grad(fn(), [logits], grad))
            row.note = f"logits are {nv / 2**20:.0f} MiB"
        except Exception as exc:
            row.note = f"{type(exc).__name__}: {str(exc)[:120]}"
        report.rows.append(row)
        torch.cuda.empty_cache()


def _attention_flops(b: int, h: int, d: int, allowed_pairs: int) -> float:
    return 4.0 * b * h * d * allowed_pairs  # QK^T and PV, 2 FLOPs per multiply-add, only unmasked pairs


def bench_attention(report: Report, quick: bool) -> None:
    from mcore.kernels import attention

    b, s, hq, hk, d = 2, 4096, 32, 8, 128
    dt = torch.bfloat16

    def qkv():
        q = torch.randn(s, b, hq, d, device="cuda", dtype=dt).transpose(0, 1).requires_grad_()
        k = torch.randn(s, b, hk, d, device="cuda", dtype=dt).transpose(0, 1).requires_grad_()
        v = torch.randn(s, b, hk, d, device="cuda", dtype=dt).transpose(0, 1).requires_grad_()
        return q, k, v

    causal_pairs = s * (s + 1) // 2
    doc = 512
    cu = torch.arange(0, b * s + 1, doc, dtype=torch.int32)  # on the CPU: checked without a device sync
    window = 1024
    window_pairs = sum(min(i + 1, window) for i in range(s))
    cases = [
        ("causal GQA 32/8", {}, causal_pairs, ["sdpa", "flex", "reference", "compiled reference"]),
        (
            f"documents {s // doc}x{doc}",
            {"cu_seqlens": cu},
            (s // doc) * doc * (doc + 1) // 2,
            ["sdpa", "flex", "reference"],
        ),
        (f"window {window}", {"window_size": window}, window_pairs, ["sdpa", "flex", "reference"]),
        ("causal + sinks", {"sinks": torch.randn(hq, device="cuda")}, causal_pairs, ["flex", "reference"]),
    ]
    for name, kwargs, pairs, backends in cases:
        q, k, v = qkv()
        impls = {}
        for backend in backends:
            if backend == "compiled reference":
                compiled = torch.compile(lambda q, k, v: attention(q, k, v, backend="reference"))
                impls[backend] = lambda compiled=compiled, q=q, k=k, v=v: compiled(q, k, v)
            else:
                impls[backend] = lambda backend=backend, q=q, k=k, v=v, kw=kwargs: attention(
                    q, k, v, backend=backend, **kw
                )
        _add_timed(
            report,
            "attention",
            f"b{b} s{s} d{d} {name}",
            impls,
            [q, k, v],
            0,
            0,
            _attention_flops(b, hq, d, pairs),
            quick,
        )
        del q, k, v


def _fmt(x: float | None, digits: int = 1) -> str:
    return "" if x is None else f"{x:.{digits}f}"


def markdown(report: Report) -> str:
    lines = [
        f"device: {report.device}; torch {report.torch}; triton {report.triton}; {report.date}; commit {report.commit}",
        f"ceilings: copy {report.ceilings.get('copy_gbps', 0):.0f} GB/s (read + write), "
        f"bf16 GEMM 8192^3 {report.ceilings.get('gemm_bf16_tflops', 0):.0f} TFLOP/s",
        "",
        "| op | case | pass | impl | ms | GB/s | % copy | TFLOP/s | peak MiB | note |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in report.rows:
        lines.append(
            f"| {r.op} | {r.case} | {r.mode} | {r.impl} | {_fmt(r.ms, 3)} | {_fmt(r.gbps, 0)} | {_fmt(r.pct_copy, 0)} "
            f"| {_fmt(r.tflops, 0)} | {_fmt(r.peak_mb, 0)} | {r.note} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results as JSON to this path")
    parser.add_argument("--quick", action="store_true", help="fewer timing repetitions")
    parser.add_argument(
        "--only", nargs="*", choices=["elementwise", "cross_entropy", "attention"], help="run only these groups"
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "benchmarks/kernel_throughput.py needs a CUDA GPU (torch.cuda.is_available() is False); "
            "nothing was measured.",
            file=sys.stderr,
        )
        return 2
    import triton

    torch.manual_seed(0)
    report = Report(
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        commit=_commit(),
    )
    measure_ceilings(report, args.quick)
    groups = {"elementwise": bench_elementwise, "cross_entropy": bench_cross_entropy, "attention": bench_attention}
    for name, run in groups.items():
        if args.only and name not in args.only:
            continue
        try:
            run(report, args.quick)
        except Exception:  # one group failing to set up must not hide the others
            report.rows.append(Row(name, "setup", "-", "-", note=traceback.format_exc().splitlines()[-1][:200]))
        torch.cuda.empty_cache()
    print(markdown(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(asdict(report), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
