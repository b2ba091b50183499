#!/usr/bin/env python3
"""Mamba-2 / Nemotron-H throughput on one GPU, beside Hugging Face's torch path.

(a) kernels: the SSD scan and the causal conv1d + SiLU, forward + backward, ours (``mcore.kernels.ssd_scan`` and
    ``causal_conv1d``) against transformers' torch fallbacks (``mamba2_chunk_scan``, ``causal_conv1d_fn`` of
    ``transformers.models.mamba2``) on the Nemotron-H-8B mixer shape (128 heads x 64, state 128, 8 groups, chunk 128,
    conv 4 over d_inner + 2 G N = 10240 channels; seq 4096, batch 1), bf16 inputs. The conv runs on the layout the
    mixers give it (ours: the strided xBC slice of in_proj's output; HF: its transpose), forward alone and forward +
    backward. Reported: median ms, the SSD's TFLOP/s by the model-FLOP convention below (against 989 TFLOP/s bf16)
    and the conv's GB/s on its byte floor (x and y forward, x, dy and dx backward) against the measured 4.03 TB/s
    copy bandwidth, ours / HF speedups, and ours-vs-HF differences.
(b) training step on ``nemotron-h-8b-4l`` (Nemotron-H-8B layers M - M *, seq 4096, micro-batch 1): the real
    ``mcore-train`` step (``load_config`` -> ``Trainer``: bf16 compute, fp32 master weights and AdamW states) in
    each of :data:`TRAIN_CONFIGS`, each in its own process, beside ``../shared/bench/hf_hybrid_baseline.py`` (fp32
    weights under bf16 autocast, eager and torch.compile, each in its own process) unless ``--skip-hf``. FLOPs per
    token from ``mcore.models.accounting.model_flops_per_token`` (equal to the baseline's formula; a test checks it).

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
from collections.abc import Sequence
from pathlib import Path

import torch
from _common import RunSpec, child_env, launch_workers, report_launch, run_spec, shared_bench, write_json
from ssm_sweep import ssd_kernel_calls, sweep

ROOT = Path(__file__).resolve().parents[1]
HF_BASELINE = shared_bench("hf_hybrid_baseline.py")
PEAK_FLOPS = 989.4e12
COPY_BYTES = 4.03e12  # measured H200 copy bandwidth (benchmarks/results/calibration-h200-2026-12-01)

TRAIN_SHAPES = {"nemotronh8b4l": ("nemotron-h-8b-4l", 4096), "tiny": ("nemotron_h-tiny", 32)}  # preset, seq
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


def kernel_times(fn, iters: int) -> dict:
    """GPU kernel time of one ``fn()`` from the CUDA profiler's trace (kernels, copies, memsets; mean of ``iters``
    calls): what the kernels cost without the host's launch overhead, which an op of ~0.1 ms timed on its own
    cannot hide (in a training step the host runs ahead). ``{"total_ms": .., "kernels_ms": {name: ms}}``."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory(prefix="ssm-kernels-") as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    return kernel_ms_from_trace(events, iters)


def kernel_ms_from_trace(events: list[dict], calls: int) -> dict:
    """Per-call GPU time (ms) of a Chrome trace's kernels, copies and memsets: in total and by (truncated) name."""
    per_name: dict[str, float] = {}
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e:
            per_name[e["name"][:80]] = per_name.get(e["name"][:80], 0.0) + e["dur"] / calls / 1e3
    return {"total_ms": sum(per_name.values()), "kernels_ms": dict(sorted(per_name.items(), key=lambda kv: -kv[1]))}


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


def _timings(runs, measure, iters: int, ssd_flops: float, conv_bytes: dict) -> dict:
    """``{name}_ms`` of each run (a failing one records its error), TFLOP/s (SSD) or GB/s (conv), and speedups."""
    out: dict = {}
    for name, fn in runs:
        try:
            sec = measure(fn, iters)
        except Exception as exc:  # one failing variant is recorded; the others are still measured
            out[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[:2000]
            continue
        out[f"{name}_ms"] = sec * 1e3
        if name.startswith("ssd"):
            out[f"{name}_tflops"] = ssd_flops / sec / 1e12
            out[f"{name}_of_peak"] = ssd_flops / sec / PEAK_FLOPS
        else:
            floor = conv_bytes["conv_fwd" if name.endswith("_fwd") else "conv"]
            out[f"{name}_gbps"] = floor / sec / 1e9
            out[f"{name}_of_copy_bandwidth"] = floor / sec / COPY_BYTES
    for key, slow, fast in (("ssd_speedup_vs_hf", "ssd_hf", "ssd_ours"),
                            ("ssd_speedup_vs_our_torch", "ssd_ours_torch", "ssd_ours"),
                            ("ssd_speedup_vs_torch_states", "ssd_ours_torch_states", "ssd_ours"),
                            ("ssd_speedup_vs_triton_states", "ssd_ours_triton_states", "ssd_ours"),
                            ("conv_speedup_vs_hf", "conv_hf", "conv_ours"),
                            ("conv_fwd_speedup_vs_hf", "conv_hf_fwd", "conv_ours_fwd")):  # fmt: skip
        if f"{slow}_ms" in out and f"{fast}_ms" in out:
            out[key] = out[f"{slow}_ms"] / out[f"{fast}_ms"]
    return out


def _conv_kernel_table(calls: dict, iters: int, floor_bytes: float) -> dict:
    """The conv's GPU kernels alone, ours and HF's (ours' host overhead is comparable to its GPU time; HF's is hidden
    in its ~3 ms)."""
    out: dict = {}
    for name in ("conv_ours", "conv_hf"):
        try:
            out[f"{name}_kernels"] = kernel_times(calls[name], iters)
        except Exception as exc:  # the profiler is an extra; the event timings stand
            out[f"{name}_kernels_error"] = f"{type(exc).__name__}: {exc}"[:2000]
    if "conv_ours_kernels" in out and "conv_hf_kernels" in out:
        ours, theirs = out["conv_ours_kernels"]["total_ms"], out["conv_hf_kernels"]["total_ms"]
        out["conv_kernel_speedup_vs_hf"] = theirs / ours
        out["conv_ours_kernels_gbps"] = floor_bytes / (ours / 1e3) / 1e9
    return out


def bench_kernels(
    shape: str,
    device: torch.device,
    dtype: torch.dtype,
    iters: int,
    backend: str | None,
    tile_sweep: tuple[str, ...] = (),
    conv_only: bool = False,
) -> dict:
    """SSD and conv forward + backward: ours (``backend``: the device's default when ``None``), our torch backend,
    HF's torch path; plus the Triton SSD kernels alone when Triton runs (``ssd_parts_ms``)."""
    from transformers.models.mamba2 import modeling_mamba2 as hf

    from mcore.kernels import ssd_scan

    s = KERNEL_SHAPES[shape]
    measure = _timer(device)
    x, dt, A, B, C, D, dt_bias = _ssd_inputs(s, device, dtype)
    chunk = s["chunk"]

    # Backward from a fixed output gradient (no loss arithmetic in the timings, for ours and HF's alike).
    gy = torch.randn(x.shape, generator=torch.Generator(device="cpu").manual_seed(3)).to(device, dtype)

    def ours_ssd(which=backend):
        ssd_scan(x, dt, A, B, C, chunk_size=chunk, D=D, dt_bias=dt_bias, backend=which).backward(gy)

    def hf_ssd():
        hf.mamba2_chunk_scan(x, dt, A, B, C, chunk, D=D, dt_bias=dt_bias, dt_softplus=True).backward(gy)

    with torch.no_grad():
        hf_y = hf.mamba2_chunk_scan(x, dt, A, B, C, chunk, D=D, dt_bias=dt_bias, dt_softplus=True).float()
        try:
            ours_y = ssd_scan(x, dt, A, B, C, chunk_size=chunk, D=D, dt_bias=dt_bias, backend=backend).float()
            ssd_max_diff = (ours_y - hf_y).abs().max().item() / max(hf_y.abs().max().item(), 1e-30)
        except Exception as exc:  # recorded with the timings' errors below
            ssd_max_diff = f"{type(exc).__name__}: {exc}"[:2000]

    d_inner = s["heads"] * s["head_dim"]
    xc, w, bias, gc = mixer_conv_inputs(s, device, dtype)
    channels = xc.shape[-1]

    tokens = s["batch"] * s["seq"]
    ssd_flops = tokens * 6 * (2 * min(chunk, s["seq"]) * d_inner + 4 * d_inner * s["state"])
    # The conv's byte floor: forward reads x and writes y; backward reads x and dy and writes dx (5 tensors).
    tensor_bytes = tokens * channels * torch.finfo(dtype).bits // 8
    conv_bytes = {"conv": 5 * tensor_bytes, "conv_fwd": 2 * tensor_bytes}
    out = {"shape": shape, **s, "dtype": str(dtype).removeprefix("torch."), "ssd_rel_diff_vs_hf": ssd_max_diff}
    out["conv_floor_ms_at_copy_bandwidth"] = conv_bytes["conv"] / COPY_BYTES * 1e3
    out |= conv_differences(xc, w, bias, gc, backend)

    def ours_ssd_states(path):
        """The Triton backend with its two state matmuls on ``path`` ("torch": fp32 batched matmuls; "triton")
        instead of the default ("auto": the faster of the two, measured on the first call)."""
        import mcore.kernels.ssd_triton as glue

        def run():
            default, glue.STATE_MATMULS = glue.STATE_MATMULS, path
            try:
                ours_ssd()
            finally:
                glue.STATE_MATMULS = default

        return run

    runs = (("ssd_ours", ours_ssd), ("ssd_ours_torch_states", ours_ssd_states("torch")),
            ("ssd_ours_triton_states", ours_ssd_states("triton")),
            ("ssd_ours_torch", lambda: ours_ssd("reference")), ("ssd_hf", hf_ssd))  # fmt: skip
    runs = (() if conv_only else runs) + tuple(conv_calls(xc, w, bias, gc, backend).items())
    out |= _timings(runs, measure, iters, ssd_flops, conv_bytes)
    from mcore.kernels.ssd_state_choice import CHOSEN

    out["ssd_state_matmuls_chosen"] = {str(key): path for key, path in CHOSEN.items()}
    if device.type == "cuda":
        out |= _conv_kernel_table(conv_calls(xc, w, bias, gc, backend), iters, conv_bytes["conv"])
    if (device.type == "cuda" or backend == "triton") and not conv_only:
        calls = ssd_kernel_calls(s, device, dtype)
        out["ssd_parts_ms"] = {name: measure(fn, iters) * 1e3 for name, fn in calls.items()}
    if (device.type == "cuda" or backend == "triton") and tile_sweep:
        conv_step = conv_calls(xc, w, bias, gc, "triton")["conv_ours"]
        kernel_ms = (lambda fn, n: kernel_times(fn, n)["kernels_ms"]) if device.type == "cuda" else None
        out["tile_sweep_ms"] = sweep(s, conv_step, device, dtype, measure, iters, tile_sweep, kernel_ms)
    return out


def mixer_conv_inputs(s: dict, device: torch.device, dtype: torch.dtype):
    """The conv's input as the mixer has it: the ``[x | B | C]`` slice (a strided view, read in place) of in_proj's
    ``[batch, seq, z | xBC | dt]`` output; ``(x, weight, bias, output gradient)``."""
    d_inner, gn = s["heads"] * s["head_dim"], s["groups"] * s["state"]
    channels, width = d_inner + 2 * gn, 2 * d_inner + 2 * gn + s["heads"]
    gen = torch.Generator(device="cpu").manual_seed(1)
    proj = torch.randn(s["batch"], s["seq"], width, generator=gen).to(device, dtype)
    x = proj[..., d_inner : d_inner + channels].requires_grad_()
    w = (torch.randn(channels, s["conv"], generator=gen) * 0.5).to(device, dtype).requires_grad_()
    bias = torch.randn(channels, generator=gen).to(device, dtype).requires_grad_()
    return x, w, bias, torch.randn(x.shape, generator=gen).to(device, dtype)


def conv_calls(x, w, bias, gy, backend: str | None) -> dict:
    """Conv + SiLU forward + backward (and forward alone) as each mixer runs it: ours on the strided slice, HF's
    ``causal_conv1d_fn`` on its ``transpose(1, 2)`` and transposed back (``NemotronHMamba2Mixer.torch_forward``).
    Gradients by ``autograd.grad`` (nothing accumulates into ``.grad`` between timings)."""
    from transformers.models.mamba2 import modeling_mamba2 as hf

    from mcore.kernels import causal_conv1d

    def ours():
        return causal_conv1d(x, w, bias, backend=backend)

    def theirs():
        return hf.causal_conv1d_fn(x.transpose(1, 2), w, bias, activation="silu").transpose(1, 2)

    def train(fn):
        return lambda: torch.autograd.grad(fn(), (x, w, bias), gy)

    def forward(fn):
        def run():
            with torch.no_grad():
                fn()

        return run

    return {"conv_ours": train(ours), "conv_ours_fwd": forward(ours), "conv_hf": train(theirs),
            "conv_hf_fwd": forward(theirs)}  # fmt: skip


def conv_differences(x, w, bias, gy, backend: str | None) -> dict:
    """Ours against HF's conv on the benchmark's inputs: max |difference| / max |HF| of y, dx, dw and dbias."""
    from transformers.models.mamba2 import modeling_mamba2 as hf

    from mcore.kernels import causal_conv1d

    try:
        mine = causal_conv1d(x, w, bias, backend=backend)
        theirs = hf.causal_conv1d_fn(x.transpose(1, 2), w, bias, activation="silu").transpose(1, 2)
        pairs = zip((mine, *torch.autograd.grad(mine, (x, w, bias), gy)),
                    (theirs, *torch.autograd.grad(theirs, (x, w, bias), gy)))  # fmt: skip
        diffs = [
            (a.float() - b.float()).abs().max().item() / max(b.float().abs().max().item(), 1e-30) for a, b in pairs
        ]
    except Exception as exc:  # recorded; the timings still run
        return {"conv_rel_diff_vs_hf": f"{type(exc).__name__}: {exc}"[:2000]}
    return {"conv_rel_diff_vs_hf": dict(zip(("y", "dx", "dw", "dbias"), diffs, strict=True))}


# Our training configurations (each its own process): "zero1" is the fast one (bf16 parameters, fp32 gradient buffer,
# fp32 master weights + AdamW moments in the distributed optimizer: 18 bytes a parameter, 27.2 GB of state for the
# 1.51 B parameters of nemotron-h-8b-4l, against HF+compile's measured 30 GB peak); "fsdp_selective" is the lean one
# (FSDP2 at world size 1 keeps fp32 parameters + gradients + moments, 16 bytes a parameter, bf16 copies only while a
# layer runs, and the Mamba core -- conv, SSD, gated norm -- recomputed in backward).
TRAIN_CONFIGS = {
    "zero1": ["parallel.distributed_optimizer=true"],
    # resharded after forward, so that the bf16 copies do not live until backward (memory is this config's point)
    # memory checks of zero1 with the Mamba and attention cores, or whole layers, recomputed (not run by default)
    "zero1_selective": ["parallel.distributed_optimizer=true", "train.recompute=selective"],
    "zero1_full": ["parallel.distributed_optimizer=true", "train.recompute=full"],
    # the Mamba cores, the norms and the MLP layers recomputed, the attention core kept (train.recompute_modules)
    "zero1_modules": [
        "parallel.distributed_optimizer=true",
        "train.recompute=selective",
        "train.recompute_modules=[mamba_core,layernorm,mlp]",
    ],
    # FSDP2 at world size 1 with its auto settings (kept gathered forward to backward), nothing recomputed; A_log,
    # D and dt_bias in fp32 groups of their own
    "fsdp": ["parallel.dp_shard=true"],
    "fsdp_selective": [
        "parallel.dp_shard=true",
        "parallel.dp_shard_reshard_after_forward=true",
        "train.recompute=selective",
    ],  # fmt: skip
}


def training_spec(preset: str, seq: int, iters: int, warmup: int, dry_run: bool, profile: int = 0,
                  config: str = "zero1", extra: Sequence[str] = ()) -> RunSpec:  # fmt: skip
    """The real ``mcore-train`` step on ``preset``: bf16 compute with fp32 master weights and AdamW states (on the
    CPU dry run too), one of :data:`TRAIN_CONFIGS` plus ``extra`` overrides (``--override``), micro-batch 1, mock
    data."""
    overrides = [
        f"train.device={'cpu' if dry_run else 'cuda'}",
        "train.precision=bf16",
        *TRAIN_CONFIGS[config],
        *extra,
        f"data.seq_length={seq}",
        "train.micro_batch_size=1",
        "train.global_batch_size=1",
        f"train.steps={1 + warmup + iters + profile}",
        "lr.schedule=constant",
        "lr.max_lr=1e-4",
        "lr.min_lr=1e-4",
        "lr.warmup_steps=0",
    ]
    return RunSpec(f"mcore_{preset}_{config}", 1, overrides, {"preset": preset}, 1 + warmup, profile_steps=profile)


def run_ours(a: argparse.Namespace) -> int:
    """``--only mcore``: our training step in this process (a child of :func:`main`), its JSON to ``--json``."""
    preset, seq = TRAIN_SHAPES["tiny" if a.dry_run else "nemotronh8b4l"]
    (config,) = a.train_configs
    spec = training_spec(preset, seq, a.iters, a.warmup, a.dry_run, a.profile_steps, config, a.override)
    result, runtime = run_spec(spec)
    runtime.shutdown()
    keys = ("params", "tokens_per_s", "step_s", "tflops_per_gpu", "mfu", "peak_mem_gb", "first_step_s", "gpu", "torch")
    overrides = [*TRAIN_CONFIGS[config], *a.override]
    record = {"impl": "mcore", "config": config, "overrides": overrides, "preset": preset, "seq": seq}
    record |= {k: result[k] for k in keys}
    record |= {k: result[k] for k in ("precision", "flops_per_token", "step_times_s", "losses", "profile")}
    write_json(a.json, record)
    return 0


def bench_training(a: argparse.Namespace, config: str) -> dict:
    """Our step in its own process (so its memory statistics are its own); the record, or the failure's tail."""
    json_path = a.out / f"mcore_nemotronh8b4l_{config}.json"
    json_path.unlink(missing_ok=True)
    argv = ["--only", "mcore", "--json", str(json_path), "--iters", str(a.iters), "--warmup", str(a.warmup)]
    argv += ["--out", str(a.out), "--profile-steps", str(a.profile_steps), "--train-configs", config]
    argv += ["--dry-run"] if a.dry_run else []
    argv += [f"--override={o}" for o in a.override]
    launch = launch_workers(Path(__file__).resolve(), 1, argv, names=[json_path.stem],
                            log_path=a.out / f"ssm_training_{config}.log", env=child_env(dry_run=a.dry_run),
                            timeout_s=a.timeout)  # fmt: skip
    report_launch(launch)
    if launch.returncode != 0 or not json_path.is_file():
        return {"impl": "mcore", "config": config, "error": f"exit {launch.returncode}", "tail": launch.tail}
    return json.loads(json_path.read_text())


def run_hf_baseline(out: Path, compile_: bool, iters: int) -> dict:
    name = "hf_nemotronh8b4l" + ("_compile" if compile_ else "") + ".json"
    argv = [sys.executable, str(HF_BASELINE), "--shape", "nemotronh8b4l", "--json", str(out / name)]
    argv += ["--iters", str(iters)] + (["--compile"] if compile_ else [])
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"impl": "hf-transformers" + ("+compile" if compile_ else ""), "error": proc.stderr[-2000:]}
    return json.loads((out / name).read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, no HF baseline subprocess")
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2, help="untimed training steps after the first (2)")
    ap.add_argument("--skip-hf", action="store_true", help="do not run ../shared/bench/hf_hybrid_baseline.py")
    ap.add_argument("--skip-compile", action="store_true", help="run the baseline eager only")
    ap.add_argument("--kernels-only", action="store_true", help="part (a) only: no training step")
    ap.add_argument("--conv-only", action="store_true", help="part (a) for the conv alone (implies --kernels-only)")
    ap.add_argument("--skip-kernels", action="store_true", help="part (b) only: the training steps")
    ap.add_argument(
        "--sweep",
        nargs="?",
        const="ssd,conv",
        default="",
        type=str,
        help="also time alternative tile sizes (benchmarks/ssm_sweep.py) of ssd, conv or both (bare: both)",
    )
    ap.add_argument("--profile-steps", type=int, default=0, help="training steps after the timed ones run under the "
                    "CUDA profiler (step_profile.py): where the step's time goes, in the training record")  # fmt: skip
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds for each of our training runs (600)")
    ap.add_argument("--train-configs", type=lambda t: t.split(","), default=["zero1", "fsdp_selective"],
                    help=f"comma-separated, of {', '.join(TRAIN_CONFIGS)} (all)")  # fmt: skip
    ap.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                    help="an mcore-train override added to every one of our training configs (repeatable)")  # fmt: skip
    ap.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--only", choices=["mcore"], help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    unknown = sorted(set(a.train_configs) - set(TRAIN_CONFIGS))
    if unknown:
        ap.error(f"--train-configs: unknown {unknown}; known: {list(TRAIN_CONFIGS)}")
    if a.dry_run:
        a.iters, a.warmup = 2, 1
    if a.only:
        return run_ours(a)
    device = torch.device("cpu" if a.dry_run else "cuda")
    if not a.dry_run and not torch.cuda.is_available():
        ap.error("no CUDA device: use --dry-run on CPU")
    result: dict = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
                    "torch": torch.__version__, "dry_run": a.dry_run}  # fmt: skip
    path = a.out / "ssm_throughput.json"
    shape, dtype = ("tiny", torch.float32) if a.dry_run else ("nemotronh8b", torch.bfloat16)
    # The dry run checks the Triton kernels too when the interpreter is on (TRITON_INTERPRET=1).
    backend = "triton" if a.dry_run and os.environ.get("TRITON_INTERPRET") == "1" else None
    sweep_parts = tuple(filter(None, a.sweep.split(",")))
    if not a.skip_kernels:
        result["kernels"] = bench_kernels(shape, device, dtype, a.iters, backend, sweep_parts, a.conv_only)
        path.write_text(json.dumps(result, indent=1))
    if a.kernels_only or a.conv_only:
        print(json.dumps(result, indent=1))
        return 0
    if device.type == "cuda":
        torch.cuda.empty_cache()
    result["training"] = []
    # Every training run is a process of its own, one after the other: the baseline's eager step peaks at ~98 GB.
    if not (a.dry_run or a.skip_hf):
        for compile_ in (False,) if a.skip_compile else (False, True):
            result["training"].append(run_hf_baseline(a.out, compile_, a.iters))
            path.write_text(json.dumps(result, indent=1))
    for config in a.train_configs:
        result["training"].append(bench_training(a, config))
        path.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
