"""AdamW on the CPU, the step of the offloaded optimizer (``optim.offload_fraction``): torch's foreach and fused
paths against mcore's reference ``adamw_step_`` (one tensor at a time, in-place torch ops), fp32 masters and
moments, a gradient multiplier of 1 applied first (the clip coefficient of the offloaded step; 1 keeps the
gradients, which the torch paths scale in place, the same from step to step).

Memory bound: per element the step reads grad, master, exp_avg, exp_avg_sq and writes the last three (28 bytes),
so the numbers are elements per second and the bandwidth they imply. Wall-clock means over ``--steps`` after one
warm-up, with ``torch.get_num_threads()`` threads (set ``OMP_NUM_THREADS``).

::

    python benchmarks/cpu_adamw.py --json OUT.json                  # 8 tensors x 16M elements, ~1 GB
    python benchmarks/cpu_adamw.py --dry-run --json OUT.json        # tiny, for the test
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

IMPLS = ("foreach", "fused", "mcore")
HYPER = dict(lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def measure(numel: int, tensors: int, steps: int) -> dict:
    import torch

    from mcore.parallel.offload import host_adamw_step_

    sizes = [numel // tensors] * tensors
    results = {}
    reference = None
    for impl in IMPLS:
        gen = torch.Generator().manual_seed(0)  # the same start for every path
        masters = [torch.randn(s, generator=gen) for s in sizes]
        grads = [torch.randn(s, generator=gen) for s in sizes]
        m = [torch.zeros(s) for s in sizes]
        v = [torch.zeros(s) for s in sizes]
        step_tensors = [torch.zeros((), dtype=torch.float32) for _ in sizes]

        def one(k: int, impl=impl, masters=masters, grads=grads, m=m, v=v, step_tensors=step_tensors) -> None:
            host_adamw_step_(impl, masters, grads, m, v, step_tensors, steps=k, multiplier=1.0, **HYPER)

        one(1)
        start = time.perf_counter()
        for k in range(2, steps + 2):
            one(k)
        seconds = (time.perf_counter() - start) / steps
        results[impl] = {
            "seconds_per_step": seconds,
            "elements_per_s": sum(sizes) / seconds,
            "gb_per_s": 28 * sum(sizes) / seconds / 1e9,
        }
        # the three paths compute the same update (to fp32 rounding): a wrong one must not win
        first = masters[0][:1000].clone()
        if reference is None:
            reference = first
        results[impl]["max_abs_diff_vs_foreach"] = float((first - reference).abs().max())
    fastest = min(IMPLS, key=lambda i: results[i]["seconds_per_step"])
    return {
        "numel": sum(sizes),
        "tensors": tensors,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "results": results,
        "fastest": fastest,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--numel", type=int, default=128 * 2**20)
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes, for the CPU test")
    args = ap.parse_args()
    if args.dry_run:
        args.numel, args.tensors, args.steps = 4096, 4, 2
    out = measure(args.numel, args.tensors, args.steps)
    text = json.dumps(out, indent=2)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
