"""Host time of one fp8 linear: forward + backward per recipe at a tiny shape, where the GPU's work is negligible, so
the wall time per call is what the host spends (Python, argument checks, Triton's launcher, torch's dispatch), and
the CPU ops behind it (``torch.profiler``, self CPU time per call).

Why it matters: the 8b4l fp8 step has 17 fp8 linears; at ~1.1-1.4 ms of host time each (session 8, H200) the host,
not the GPU, set the step time, and the profile's GPU idle showed it. Writes ``OUT/fp8_host_time.json`` and ``.md``::

    python benchmarks/fp8_host_time.py --out $OUT/host        # one GPU, ~15 s
    python benchmarks/fp8_host_time.py --dry-run --out /tmp/h  # CPU: the reference path (its numbers mean little)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch
from _common import markdown_table, write_json

RECIPES = ("tensorwise", "delayed", "rowwise", "blockwise")


def host_us(fn, calls: int, cuda: bool) -> float:
    """Microseconds of wall time per ``fn()`` (forward + backward), the GPU synchronized only at the end."""
    for _ in range(3):
        fn()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    if cuda:
        torch.cuda.synchronize()
    return 1e6 * elapsed / calls


def cpu_ops(fn, calls: int, top: int) -> list[dict[str, Any]]:
    """The ``top`` CPU ops by self time, per call of ``fn``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]
    return [{"op": e.key, "self_us": e.self_cpu_time_total / calls, "count": e.count / calls} for e in events]


def python_functions(fn, calls: int, top: int) -> list[dict[str, Any]]:
    """The ``top`` Python functions by own time (cProfile), microseconds per call of ``fn`` and calls per call:
    where the host's Python goes (our wrappers, Triton's launcher, torch's autograd glue), which the op-level
    profile above folds into "self time" of the autograd function."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    stats = pstats.Stats(profiler).stats
    rows = []
    for (filename, line, name), (_, ncalls, tottime, cumtime, _) in stats.items():
        where = "/".join(Path(filename).parts[-2:]) if filename.startswith("/") else filename
        rows.append({"function": f"{where}:{line}({name})", "own_us": 1e6 * tottime / calls,
                     "cum_us": 1e6 * cumtime / calls, "count": ncalls / calls})  # fmt: skip
    return sorted(rows, key=lambda r: -r["own_us"])[:top]


def measure(device: torch.device, size: int, calls: int, top: int) -> dict[str, Any]:
    from mcore.kernels.low_precision_linear import LowPrecisionLinear, Recipe

    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    x = torch.randn(size, size, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(size, size, device=device, dtype=dtype, requires_grad=True)
    g = torch.randn(size, size, device=device, dtype=dtype)
    steps = {"bf16" if cuda else "fp32": lambda: torch.nn.functional.linear(x, w).backward(g)}
    for name in RECIPES:
        layer = LowPrecisionLinear(Recipe(name))
        steps[name] = lambda layer=layer: layer(x, w).backward(g)
    rows = [{"impl": name, "host_us": host_us(fn, calls, cuda)} for name, fn in steps.items()]
    profiles = {name: cpu_ops(steps[name], max(1, calls // 10), top) for name in RECIPES}
    python = {name: python_functions(steps[name], max(1, calls // 4), top) for name in RECIPES}
    return {"rows": rows, "cpu_ops": profiles, "python": python}


def render(data: dict[str, Any]) -> str:
    parts = [f"# fp8 linear host time ({data['device']}, torch {data['torch']}, {data['date']}, {data['size']}^2)"]
    parts.append(
        markdown_table(["impl", "host us per forward + backward"], [[r["impl"], r["host_us"]] for r in data["rows"]])
    )
    for name, ops in data["cpu_ops"].items():
        parts.append(f"{name}: top CPU ops (self us per call, count per call)\n\n" + markdown_table(
            ["op", "self us", "count"], [[o["op"][:80], o["self_us"], o["count"]] for o in ops]))  # fmt: skip
    for name, funcs in data.get("python", {}).items():
        title = f"{name}: top Python functions (own us per call, cumulative us, count per call)"
        table = markdown_table(["function", "own us", "cum us", "count"],
                               [[f["function"][:90], f["own_us"], f["cum_us"], f["count"]] for f in funcs])  # fmt: skip
        parts.append(f"{title}\n\n{table}")
    return "\n\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dry-run", action="store_true", help="CPU, the reference path, few calls")
    parser.add_argument("--size", type=int, default=256, help="square x, W and grad (256: the GPU work is negligible)")
    parser.add_argument("--calls", type=int, default=None, help="timed calls per implementation (200; dry run 4)")
    parser.add_argument("--top", type=int, default=20, help="CPU ops listed per recipe")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device: run with --dry-run on CPU")
    device = torch.device("cpu" if args.dry_run else "cuda")
    calls = args.calls or (4 if args.dry_run else 200)
    data = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "size": args.size,
        **measure(device, args.size, calls, args.top),
    }
    write_json(args.out / "fp8_host_time.json", data)
    text = render(data)
    (args.out / "fp8_host_time.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
