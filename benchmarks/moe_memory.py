"""Where an MoE training step's peak memory goes: the state held between steps, the forward + backward peak and
the optimizer step's peak, step by step (CUDA ``memory_allocated`` / ``max_memory_allocated``).

Builds the run of ``moe_throughput.py``'s shape (the real ``mcore-train`` trainer; ``--fsdp`` for FSDP2) and
wraps the optimizer's ``step`` to read the peak before it (forward + backward, gradients included) and during it.
``bytes_per_param`` is the state held after a step over the parameter count: 18 for bf16 weights with fp32
masters, gradients and AdamW moments (ZeRO-1 at dp=1), 16 for fp32 weights (FSDP2, HF's layout). ``after_forward``:
what the step holds when the forward of its (last) micro-batch ends (state + activations kept for backward).
``--expert-gemm per_expert``: the experts' weight gradients accumulate in fp32 into ``main_grad`` (no bf16 copy).

::

    python benchmarks/moe_memory.py --shape mixtral2l --json OUT.json [--layout fsdp] [--expert-gemm per_expert]
    python benchmarks/moe_memory.py --dry-run --json OUT.json       # CPU, tiny shape: no CUDA numbers (None)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from _common import _build_run, write_json
from moe_throughput import EXPERT_GEMMS, GPU_SHAPES, LAYOUTS, build_spec


def _gb(value: int | None) -> float | None:
    return None if value is None else value / 1e9


def measure(
    shape: str, *, steps: int, fsdp: bool, dry_run: bool, expert_gemm: str = "grouped", layout: str | None = None
) -> dict[str, Any]:
    import torch

    from mcore.models.accounting import parameter_counts
    from mcore.train.datasets import build_run_data, microbatch_stream
    from mcore.train.trainer import microbatch_to_device

    layout = layout or ("fsdp" if fsdp else "zero1")
    spec = build_spec(shape, iters=steps, warmup=0, dry_run=dry_run, expert_gemm=expert_gemm, layout=layout)
    config, runtime, trainer, _ = _build_run(spec)
    device = runtime.device
    cuda = device.type == "cuda"

    def allocated() -> int | None:
        return torch.cuda.memory_allocated(device) if cuda else None

    def peak() -> int | None:
        return torch.cuda.max_memory_allocated(device) if cuda else None

    marks: dict[str, int | None] = {}
    step = trainer.optimizer.step

    def measured_step():
        marks["forward_backward_peak"], marks["before_optimizer"] = peak(), allocated()
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        result = step()
        marks["optimizer_peak"] = peak()
        return result

    trainer.optimizer.step = measured_step

    def after_forward(module, args, output):
        marks["after_forward"] = allocated()

    for chunk in trainer.chunks:
        chunk.register_forward_hook(after_forward)
    data = build_run_data(config)
    g = trainer.groups
    stream = microbatch_stream(
        data.train, config, consumed_samples=trainer.consumed_samples, dp_rank=g.dp_rank, dp_size=g.dp_size
    )
    records = [{"after_build_gb": _gb(allocated())}]
    for _ in range(steps):
        micro = [microbatch_to_device(next(stream), device) for _ in range(trainer.num_microbatches)]
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        start = allocated()
        trainer.train_step(micro)
        if cuda:
            torch.cuda.synchronize(device)
        records.append(
            {"start_gb": _gb(start), **{f"{k}_gb": _gb(v) for k, v in marks.items()}, "end_gb": _gb(allocated())}
        )
    params = parameter_counts(config.model).total
    held = records[-1]["end_gb"]
    runtime.shutdown()
    return {
        "shape": shape,
        "layout": {"fsdp": "fsdp2", "fsdp_reshard": "fsdp2_reshard"}.get(layout, layout),
        "expert_gemm": expert_gemm,
        "params": params,
        "steps": records,
        "bytes_per_param": None if held is None else held * 1e9 / params,
        "peak_gb": max(max(r["forward_backward_peak_gb"], r["optimizer_peak_gb"]) for r in records[1:])
        if cuda
        else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=GPU_SHAPES, default="mixtral2l")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--fsdp", action="store_true", help="FSDP2 (parallel.dp_shard=true) instead of ZeRO-1")
    ap.add_argument("--layout", choices=LAYOUTS, default=None, help="memory layout (moe_throughput's; --fsdp: fsdp)")
    ap.add_argument("--expert-gemm", choices=EXPERT_GEMMS, default="grouped", help="moe_router.expert_gemm")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny fp32 shape (no CUDA numbers)")
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")
    shape = "tiny" if args.dry_run else args.shape
    record = measure(
        shape, steps=args.steps, fsdp=args.fsdp, dry_run=args.dry_run, expert_gemm=args.expert_gemm, layout=args.layout
    )
    write_json(args.json, record)
    print(json.dumps({k: record[k] for k in ("shape", "layout", "bytes_per_param", "peak_gb")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
