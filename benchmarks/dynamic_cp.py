"""Static vs dynamic context parallelism on a long-tailed document-length distribution (CPU, predicted).

For each of ``--batches`` global batches of documents (``--world`` ranks x ``--tokens-per-rank`` tokens,
minus 10% left for padding), it plans static CP at each size in ``--static-cp`` (documents packed in
order into rows of ``cp x tokens_per_rank``, rows dealt to the data-parallel groups) and dynamic CP
(:func:`mcore.parallel.dynamic_cp.plan_dynamic`), and reports the per-rank attention-FLOP imbalance
(max / mean) and the predicted step time (slowest rank), hence the predicted speedup.

Document lengths: ``--lengths FILE`` (one length per line, e.g. from the token files you train on), or by
default a log-normal with the mean of FinePDFs-Edu's English documents, 4,990 tokens (18,198,668 documents,
90.81B tokens: https://huggingface.co/datasets/tturing/finepdfs-edu-32) and spread ``--sigma`` (assumed:
the source gives no spread; 1.0, 1.4 and 1.8 are all reported by default), cut to the longest document
static CP can hold. Kernel rates: issue #18's measured FlexAttention fwd+bwd TFLOP/s by document length
(the backend packed documents use without our kernel), or ``--rates attention.json`` from
``benchmarks/attention.py`` (our kernel's measured rates). Linear layers: Llama-3-8B (6 x 8.03e9 FLOPs per
token) at ``--linear-tflops``.

    python benchmarks/dynamic_cp.py --out /tmp/dcp            # a few seconds
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from pathlib import Path

from mcore.parallel.dynamic_cp import CostModel, plan_dynamic, plan_static

ISSUE_FLEX_RATES = ((128, 46.0), (512, 140.0), (4096, 334.0), (16384, 381.0))
FINEPDFS_EDU_MEAN_TOKENS = 4990


def lognormal_lengths(rng: random.Random, mean: float, sigma: float, longest: int, total: int) -> list[int]:
    """Documents (lengths rounded up to a multiple of 16, so every CP size up to 8 splits them) until ``total``."""
    mu = math.log(mean) - sigma * sigma / 2  # E[exp(N(mu, sigma))] = mean
    out, tokens = [], 0
    while True:
        n = min(longest, max(16, int(rng.lognormvariate(mu, sigma))))
        n = -(-n // 16) * 16
        if tokens + n > total:
            return out
        out.append(n)
        tokens += n


def batches_from_file(path: Path, rng: random.Random, total: int, longest: int, count: int) -> list[list[int]]:
    lengths = [int(x) for x in path.read_text().split() if x.strip()]
    if not lengths:
        raise ValueError(f"{path}: no document lengths (one integer per line expected)")
    batches = []
    for _ in range(count):
        batch, tokens = [], 0
        while True:
            n = -(-min(longest, max(16, rng.choice(lengths))) // 16) * 16
            if tokens + n > total:
                break
            batch.append(n)
            tokens += n
        batches.append(batch)
    return batches


def rates_from(path: Path | None) -> tuple[tuple[int, float], ...]:
    if path is None:
        return ISSUE_FLEX_RATES
    report = json.loads(path.read_text())
    points = []
    for case in report["cases"]:
        row = case["impls"].get("ours", {})
        if case["d_qk"] == case["d_v"] == 128 and "fwd_bwd_tflops" in row and "sinks" not in case["case"]:
            points.append((case["length"], row["fwd_bwd_tflops"]))
    if len(points) < 2:
        raise ValueError(f"{path}: fewer than two measured 'ours' cases with D 128")
    return tuple(sorted(points))


def compare(batches: list[list[int]], args, model: CostModel) -> dict:
    rows = {}
    for cp in args.static_cp:
        plans = [plan_static(b, args.world, cp, args.tokens_per_rank, model) for b in batches]
        rows[f"static cp{cp}"] = plans
    rows["dynamic"] = [plan_dynamic(b, args.world, args.tokens_per_rank, model) for b in batches]
    base = {k: sum(p.step_seconds() for p in v) for k, v in rows.items()}
    return {
        name: {
            "imbalance_mean": statistics.mean(p.imbalance() for p in plans),
            "imbalance_max": max(p.imbalance() for p in plans),
            "time_imbalance_mean": statistics.mean(max(p.seconds) / statistics.mean(p.seconds) for p in plans),
            "step_seconds_mean": base[name] / len(plans),
            "dynamic_speedup": base[name] / base["dynamic"],
        }
        for name, plans in rows.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".")
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--tokens-per-rank", type=int, default=16384)
    parser.add_argument("--static-cp", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--batches", type=int, default=50)
    parser.add_argument("--sigma", type=float, nargs="+", default=[1.0, 1.4, 1.8])
    parser.add_argument("--lengths", type=Path, help="document lengths, one per line (instead of the log-normal)")
    parser.add_argument("--rates", type=Path, help="attention.json of benchmarks/attention.py (our kernel's rates)")
    parser.add_argument("--linear-tflops", type=float, default=400.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    model = CostModel(rates_from(args.rates), 32, 128, 32, 6 * 8.03e9, args.linear_tflops)
    total = int(0.9 * args.world * args.tokens_per_rank)  # room for the static packing's padding
    longest = min(args.static_cp) * args.tokens_per_rank  # every static layout can hold every document
    report = {"world": args.world, "tokens_per_rank": args.tokens_per_rank, "rates": model.attention_rates}
    report["distributions"] = {}
    sources = [(f"lognormal mean {FINEPDFS_EDU_MEAN_TOKENS} sigma {s}", s) for s in args.sigma]
    if args.lengths is not None:
        sources = [(f"file {args.lengths.name}", None)]
    for name, sigma in sources:
        rng = random.Random(args.seed)
        if sigma is None:
            batches = batches_from_file(args.lengths, rng, total, longest, args.batches)
        else:
            batches = [
                lognormal_lengths(rng, FINEPDFS_EDU_MEAN_TOKENS, sigma, longest, total) for _ in range(args.batches)
            ]
        result = compare(batches, args, model)
        result["documents_per_batch"] = statistics.mean(len(b) for b in batches)
        report["distributions"][name] = result
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "dynamic_cp.json").write_text(json.dumps(report, indent=1))
    lines = ["| lengths | layout | attention-FLOP imbalance (mean / worst) | step-time imbalance | step s (predicted) "
             "| dynamic speedup |", "|---|---|---:|---:|---:|---:|"]  # fmt: skip
    for name, result in report["distributions"].items():
        for layout, row in result.items():
            if isinstance(row, dict):
                lines.append(
                    f"| {name} | {layout} | {row['imbalance_mean']:.2f} / {row['imbalance_max']:.2f} | "
                    f"{row['time_imbalance_mean']:.2f} | "
                    f"{row['step_seconds_mean']:.3f} | {row['dynamic_speedup']:.2f}x |"
                )
    (out / "dynamic_cp.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
