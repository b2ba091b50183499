#!/usr/bin/env python3
"""Mamba-2 / Nemotron-H throughput on one GPU, beside Hugging Face's torch path.

(a) kernels: the SSD scan and the causal conv1d + SiLU, forward + backward, ours (``mcore.kernels.ssd_scan`` and
    ``causal_conv1d``) against transformers' torch fallbacks (``mamba2_chunk_scan``, ``causal_conv1d_fn`` of
    ``transformers.models.mamba2``) on the Nemotron-H-8B mixer shape (128 heads x 64, state 128, 8 groups, chunk 128,
    conv 4 over d_inner + 2 G N = 10240 channels; seq 4096, batch 1), bf16 inputs. Reported: median ms, the SSD's
    TFLOP/s by the model-FLOP convention below and the conv's GB/s (bytes of its input, output, their gradients),
    against DESIGN.md's ceilings (989 TFLOP/s bf16, 4.8 TB/s HBM3e), and ours / HF speedups.
(b) training step on ``nemotron-h-8b-4l`` (Nemotron-H-8B layers M - M *, seq 4096, micro-batch 1): fp32 weights,
    bf16 autocast, fused AdamW, eager and torch.compile, the same recipe as ``../shared/bench/hf_hybrid_baseline.py``,
    which this script also runs (eager and compile, in subprocesses) unless ``--skip-hf``. FLOPs per token from
    ``mcore.models.accounting.model_flops_per_token`` (equal to the baseline's formula; a test checks it).

Usage (GPU machine, repo root, ``export PYTHONPATH=$(ls -d packages/*/src | paste -sd:)``):
    python benchmarks/ssm_throughput.py --out $OUT              (add --kernels-only for part (a) alone)
CPU check of the whole path with tiny shapes (what tests/test_ssm_benchmark.py runs):
    python benchmarks/ssm_throughput.py --dry-run --out /tmp/ssm
Writes ``<out>/ssm_throughput.json`` (and the baseline's JSON files beside it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
HF_BASELINE = ROOT.parent / "shared" / "bench" / "hf_hybrid_baseline.py"
PEAK_FLOPS, PEAK_BYTES = 989.4e12, 4.8e12

KERNEL_SHAPES = {
    "nemotronh8b": dict(batch=1, seq=4096, heads=128, head_dim=64, groups=8, state=128, chunk=128, conv=4),
    "tiny": dict(batch=1, seq=32, heads=4, head_dim=8, groups=2, state=8, chunk=8, conv=4),
}


def _timer(device: torch.device):
    def measure(fn, iters: int, warmup: int = 1) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters):
            if device.type == "cuda":
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    return measure


def _ssd_inputs(s, device, dtype):
    g = torch.Generator(device="cpu").manual_seed(0)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device, dtype).requires_grad_()

    b, length, h, p, gr, n = s["batch"], s["seq"], s["heads"], s["head_dim"], s["groups"], s["state"]
    x, dt = r(b, length, h, p), r(b, length, h, scale=0.5)
    B, C = r(b, length, gr, n), r(b, length, gr, n)
    A = (-torch.exp(torch.rand(h, generator=g))).to(device).requires_grad_()
    D, dt_bias = r(h).float().detach().requires_grad_(), r(h, scale=0.5).float().detach().requires_grad_()
    return x, dt, A, B, C, D, dt_bias


def _ssd_parts(s: dict, device: torch.device, dtype: torch.dtype, measure, iters: int) -> dict:
    """Milliseconds of each Triton SSD kernel alone (forward and backward) on the shape; the rest of the Triton
    backend's time is its torch matmuls and elementwise work."""
    from mcore.kernels.triton import ssd as kernels

    b, length, h, p, g, n, q = (s[k] for k in ("batch", "seq", "heads", "head_dim", "groups", "state", "chunk"))
    nc = -(-length // q)
    gen = torch.Generator(device="cpu").manual_seed(2)
    x = torch.randn(b, nc * q, h, p, generator=gen).to(device, dtype)
    dt = (torch.rand(b, nc * q, h, generator=gen) * 0.1).to(device)
    cs = torch.cumsum(-dt.view(b, nc, q, h), dim=2).reshape(b, nc * q, h).contiguous()
    cb = torch.randn(b, nc, g, q, q, generator=gen).to(device)
    dy = torch.randn(x.shape, generator=gen).to(device)
    local = torch.randn(b, nc, h, p * n, generator=gen).to(device)
    carry = torch.rand(b, nc, h, generator=gen).to(device)
    incoming, _ = kernels.state_forward(local, carry, None)
    calls = {
        "intra_fwd": lambda: kernels.intra_forward(x, dt, cs, None, cb),
        "intra_bwd": lambda: kernels.intra_backward(dy, x, dt, cs, None, cb),
        "state_fwd": lambda: kernels.state_forward(local, carry, None),
        "state_bwd": lambda: kernels.state_backward(carry, incoming, local, local[:, 0]),
    }
    return {name: measure(fn, iters) * 1e3 for name, fn in calls.items()}


def bench_kernels(shape: str, device: torch.device, dtype: torch.dtype, iters: int, backend: str | None) -> dict:
    """SSD and conv forward + backward: ours (``backend``: the device's default when ``None``), our torch backend,
    HF's torch path; plus the Triton SSD kernels alone when Triton runs (``ssd_parts_ms``)."""
    from transformers.models.mamba2 import modeling_mamba2 as hf

    from mcore.kernels import causal_conv1d, ssd_scan

    s = KERNEL_SHAPES[shape]
    measure = _timer(device)
    x, dt, A, B, C, D, dt_bias = _ssd_inputs(s, device, dtype)
    chunk = s["chunk"]

    def ours_ssd(which=backend):
        y = ssd_scan(x, dt, A, B, C, chunk_size=chunk, D=D, dt_bias=dt_bias, backend=which)
        y.float().square().mean().backward()

    def hf_ssd():
        y = hf.mamba2_chunk_scan(x, dt, A, B, C, chunk, D=D, dt_bias=dt_bias, dt_softplus=True)
        y.float().square().mean().backward()

    with torch.no_grad():
        ours_y = ssd_scan(x, dt, A, B, C, chunk_size=chunk, D=D, dt_bias=dt_bias, backend=backend).float()
        hf_y = hf.mamba2_chunk_scan(x, dt, A, B, C, chunk, D=D, dt_bias=dt_bias, dt_softplus=True).float()
    ssd_max_diff = (ours_y - hf_y).abs().max().item() / max(hf_y.abs().max().item(), 1e-30)

    d_inner = s["heads"] * s["head_dim"]
    channels = d_inner + 2 * s["groups"] * s["state"]
    gen = torch.Generator(device="cpu").manual_seed(1)
    xc = torch.randn(s["batch"], s["seq"], channels, generator=gen).to(device, dtype).requires_grad_()
    w = torch.randn(channels, s["conv"], generator=gen).to(device, dtype).requires_grad_()
    bias = torch.randn(channels, generator=gen).to(device, dtype).requires_grad_()

    def ours_conv():
        causal_conv1d(xc, w, bias, backend=backend).float().square().mean().backward()

    def hf_conv():
        out = hf.causal_conv1d_fn(xc.transpose(1, 2), w, bias, activation="silu")
        out.float().square().mean().backward()

    tokens = s["batch"] * s["seq"]
    ssd_flops = tokens * 6 * (2 * min(chunk, s["seq"]) * d_inner + 4 * d_inner * s["state"])
    conv_bytes = 4 * tokens * channels * torch.finfo(dtype).bits // 8  # x, out, grad out, grad x
    out = {"shape": shape, **s, "dtype": str(dtype).removeprefix("torch."), "ssd_rel_diff_vs_hf": ssd_max_diff}
    runs = (("ssd_ours", ours_ssd), ("ssd_ours_torch", lambda: ours_ssd("reference")), ("ssd_hf", hf_ssd),
            ("conv_ours", ours_conv), ("conv_hf", hf_conv))  # fmt: skip
    for name, fn in runs:
        sec = measure(fn, iters)
        out[f"{name}_ms"] = sec * 1e3
        if name.startswith("ssd"):
            out[f"{name}_tflops"] = ssd_flops / sec / 1e12
            out[f"{name}_of_peak"] = ssd_flops / sec / PEAK_FLOPS
        else:
            out[f"{name}_gbps"] = conv_bytes / sec / 1e9
            out[f"{name}_of_peak"] = conv_bytes / sec / PEAK_BYTES
    out["ssd_speedup_vs_hf"] = out["ssd_hf_ms"] / out["ssd_ours_ms"]
    out["ssd_speedup_vs_our_torch"] = out["ssd_ours_torch_ms"] / out["ssd_ours_ms"]
    out["conv_speedup_vs_hf"] = out["conv_hf_ms"] / out["conv_ours_ms"]
    if device.type == "cuda" or backend == "triton":
        out["ssd_parts_ms"] = _ssd_parts(s, device, dtype, measure, iters)
    return out


def bench_training(preset: str, overrides: dict, device: torch.device, compile_: bool, iters: int, seq: int) -> dict:
    from mcore.models.accounting import H200_BF16_PEAK_FLOPS, model_flops_per_token, parameter_counts
    from mcore.models.families import get_config
    from mcore.models.gpt import GPTModel

    config = get_config(preset, **overrides)
    torch.manual_seed(0)
    model = GPTModel(config, device=device)
    model.init_weights(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    fwd = torch.compile(model) if compile_ else model
    ids = torch.randint(0, config.vocab_size, (1, seq), device=device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step():
        with autocast:
            loss = fwd(ids, labels=ids).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    first = time.perf_counter() - t0
    sec = _timer(device)(step, iters)
    flops = model_flops_per_token(config, seq) * seq
    return {
        "impl": "mcore" + ("+compile" if compile_ else ""),
        "preset": preset,
        "seq": seq,
        "params": parameter_counts(config).total,
        "tokens_per_s": seq / sec,
        "step_s": sec,
        "tflops_per_gpu": flops / sec / 1e12,
        "mfu": flops / sec / H200_BF16_PEAK_FLOPS,
        "peak_mem_gb": torch.cuda.max_memory_allocated() / 1e9 if device.type == "cuda" else None,
        "first_step_s": first,
    }


def run_hf_baseline(out: Path, compile_: bool) -> dict:
    name = "hf_nemotronh8b4l" + ("_compile" if compile_ else "") + ".json"
    argv = [sys.executable, str(HF_BASELINE), "--shape", "nemotronh8b4l", "--json", str(out / name)]
    proc = subprocess.run(argv + (["--compile"] if compile_ else []), capture_output=True, text=True)
    if proc.returncode != 0:
        return {"impl": "hf-transformers" + ("+compile" if compile_ else ""), "error": proc.stderr[-2000:]}
    return json.loads((out / name).read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, no HF baseline subprocess")
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--skip-hf", action="store_true", help="do not run ../shared/bench/hf_hybrid_baseline.py")
    ap.add_argument("--skip-compile", action="store_true")
    ap.add_argument("--kernels-only", action="store_true", help="part (a) only: no training step")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cpu" if a.dry_run else "cuda")
    if not a.dry_run and not torch.cuda.is_available():
        ap.error("no CUDA device: use --dry-run on CPU")
    iters = 2 if a.dry_run else a.iters
    result: dict = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
                    "torch": torch.__version__, "dry_run": a.dry_run}  # fmt: skip
    path = a.out / "ssm_throughput.json"
    shape, dtype = ("tiny", torch.float32) if a.dry_run else ("nemotronh8b", torch.bfloat16)
    # The dry run checks the Triton kernels too when the interpreter is on (TRITON_INTERPRET=1).
    backend = "triton" if a.dry_run and os.environ.get("TRITON_INTERPRET") == "1" else None
    result["kernels"] = bench_kernels(shape, device, dtype, iters, backend)
    path.write_text(json.dumps(result, indent=1))
    if a.kernels_only:
        print(json.dumps(result, indent=1))
        return 0
    if device.type == "cuda":
        torch.cuda.empty_cache()
    preset, seq = ("nemotron_h-tiny", 32) if a.dry_run else ("nemotron-h-8b-4l", 4096)
    modes = (False,) if (a.skip_compile or a.dry_run) else (False, True)
    result["training"] = []
    # The baseline runs first, in its own processes, while this one holds no model: its eager step peaks at
    # ~98 GB, and a compiled model of ours would keep its memory alive here (dynamo's caches reference it).
    if not (a.dry_run or a.skip_hf):
        for compile_ in modes:
            result["training"].append(run_hf_baseline(a.out, compile_))
            path.write_text(json.dumps(result, indent=1))
    for compile_ in modes:
        result["training"].append(bench_training(preset, {}, device, compile_, iters, seq))
        path.write_text(json.dumps(result, indent=1))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
