"""How often delayed fp8 scaling clips: per cast, the amax the scale came from against the tensor's own amax.

Delayed scaling (``fp8.recipe=delayed``) scales each tensor by an amax from earlier calls (the max of the last
``fp8.amax_history_len``, or the most recent) and measures the tensor's own amax in the same pass. Where the own
amax is larger, every element above the scale's amax saturates to the fp8 maximum: the cast clips. Current
scaling never does. This trains one configuration of ``low_precision_convergence.py`` (a delayed one) and counts,
for the activations ``x``, weights ``w`` and gradients ``g`` of every fp8 linear, the casts that clipped and by how
much (own amax / scale amax), over the whole run and over its second half. With ``fp8.delayed_overflow=recast``
(``--config fp8-delayed-recast``) a cast that overflowed is cast again from its own amax: the table counts those
as ``recast``, and ``clipped`` (what still saturated) must be 0.

The counting wraps ``AmaxHistory.quantize`` (the library has no hook for it); it reads one scalar per cast back to
the host, so step times here are not the recipe's.

::

    python benchmarks/fp8_delayed_clipping.py --device cuda --steps 500 --seed 3 --out $OUT/clipping
    python benchmarks/fp8_delayed_clipping.py --model demo --text embedded --steps 100 --out DIR      # CPU
    python benchmarks/fp8_delayed_clipping.py --dry-run --out DIR                                     # CI test

Writes ``DIR/fp8_delayed_clipping.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from _common import markdown_table, run_spec, write_json
from low_precision_convergence import CONFIGS, MODEL_DATA, build_spec

OPERANDS = ("x", "w", "g")


@contextmanager
def recording_casts() -> Iterator[dict[str, list[tuple[float, float, bool]]]]:
    """Within the block, every delayed cast appends ``(scale amax, own amax, recast)`` under its operand (``x``,
    ``w``, ``g``); ``recast``: the scale the cast returned is not the one of the history's amax (the recast of
    ``delayed_overflow=recast`` replaced it). The first cast of a history (current scaling) is left out."""
    from mcore.kernels.fp8_delayed import AmaxHistory
    from mcore.kernels.low_precision_linear import LowPrecisionLinear
    from mcore.kernels.quantization import FP8_MAX, scale_from_amax

    records: dict[str, list[tuple[float, float, bool]]] = defaultdict(list)
    original_init, original_quantize = LowPrecisionLinear.__init__, AmaxHistory.quantize

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        for operand, history in self.histories.items():
            history.operand = operand

    def quantize(self, t, dtype, **kwargs):
        used = self.scale_amax()
        slot = self.count % self.slots  # where this call records its own amax
        pair = original_quantize(self, t, dtype, **kwargs)
        if used is not None:
            # judged from the scale returned, not from the mode: a recast that did not happen counts as a clip
            recast = float(pair[0].scale) != float(scale_from_amax(used, FP8_MAX[dtype])[1])
            records[getattr(self, "operand", "?")].append((float(used), float(self.history[slot]), recast))
        return pair

    LowPrecisionLinear.__init__, AmaxHistory.quantize = init, quantize
    try:
        yield records
    finally:
        LowPrecisionLinear.__init__, AmaxHistory.quantize = original_init, original_quantize


def clipping_stats(records: list[tuple]) -> dict[str, Any]:
    """Of ``(scale amax, own amax[, recast])`` records: the casts, how many were recast, how many clipped (own
    amax above the scale's and not recast), and the ratios own / scale amax of the ones that overflowed the
    history's amax (clipped or recast: with saturation those are the clipped ones)."""
    records = [(used, own, bool(rest and rest[0])) for used, own, *rest in records if used > 0]
    ratios = sorted(own / used for used, own, _ in records if own > used)
    clipped = sum(1 for used, own, recast in records if own > used and not recast)
    return {
        "casts": len(records),
        "recast": sum(1 for *_, recast in records if recast),
        "clipped": clipped,
        "clipped_fraction": clipped / len(records) if records else 0.0,
        "median_ratio": statistics.median(ratios) if ratios else None,
        "max_ratio": ratios[-1] if ratios else None,
    }


def summarize(records: dict[str, list[tuple[float, float, bool]]]) -> dict[str, dict[str, Any]]:
    """Per operand: the whole run's statistics and the second half's (the casts in call order)."""
    out = {}
    for operand in OPERANDS:
        pairs = records.get(operand, [])
        out[operand] = {"all": clipping_stats(pairs), "second_half": clipping_stats(pairs[len(pairs) // 2 :])}
    return out


def render(data: dict[str, Any]) -> str:
    def fmt(value: float | None) -> str:
        return "" if value is None else f"{value:.3g}"

    rows = []
    for operand, parts in data["operands"].items():
        for part, s in parts.items():
            rows.append([operand, part, s["casts"], s["recast"], s["clipped"], f"{100 * s['clipped_fraction']:.1f}%",
                         fmt(s["median_ratio"]), fmt(s["max_ratio"])])  # fmt: skip
    head = (
        f"# Delayed fp8 scaling: clipped casts ({data['config']}, model {data['model']}, {data['steps']} steps, "
        f"seed {data['seed']}, {data['device']}; final loss {data['final_loss']:.4f})\n\n"
        "recast: cast again from the own amax (delayed_overflow=recast); clipped: saturated (own amax above the "
        "scale's, not recast); ratios: of the casts whose own amax exceeded the history's\n\n"
    )
    columns = ["operand", "part", "casts", "recast", "clipped", "share", "median own/scale amax", "max own/scale amax"]
    return head + markdown_table(columns, rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    delayed = sorted(name for name, overrides in CONFIGS.items() if "fp8.recipe=delayed" in overrides)
    parser.add_argument("--config", choices=delayed, default="fp8-delayed")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--model", choices=tuple(MODEL_DATA), default=None, help="default: medium on cuda, else demo")
    parser.add_argument("--text", choices=("stdlib", "embedded"), default="stdlib")
    parser.add_argument("--text-mb", type=float, default=32.0, help="stdlib text: at most this many MB")
    parser.add_argument("--dry-run", action="store_true", help="demo model, 6 steps, embedded text")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error(f"--steps must be >= 2 (the first cast of each tensor has no history), got {args.steps}")
    if args.dry_run:
        args.steps, args.model, args.text, args.device = 6, "demo", "embedded", "cpu"
    model = args.model or ("medium" if args.device == "cuda" else "demo")
    data_path = None
    if args.text == "stdlib":
        from real_text import build_corpus

        data_path, _ = build_corpus(Path(tempfile.mkdtemp(prefix="mcore-text-")), int(args.text_mb * 2**20))
    with recording_casts() as records:
        result, runtime = run_spec(build_spec(args.config, args.steps, args.device, model, data_path, args.seed))
    runtime.shutdown()
    data = {
        "config": args.config,
        "model": model,
        "steps": args.steps,
        "seed": args.seed,
        "device": args.device,
        "final_loss": result["final_loss"],
        "operands": summarize(records),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "fp8_delayed_clipping.json", data)
    (args.out / "fp8_delayed_clipping.md").write_text(render(data))
    print(render(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
