"""``mcore-train plot RUN_DIR``: loss, learning rate and throughput curves of a run, drawn to a PNG."""

from __future__ import annotations

from pathlib import Path

from mcore.train.errors import UserError
from mcore.train.metrics import METRICS_FILE, read_metrics

PLOT_FILE = "curves.png"


def plot_run(run_dir: str | Path, output: str | Path | None = None) -> Path:
    """Draw ``run_dir``'s metrics to ``output`` (default ``<run_dir>/curves.png``) and return its path.

    Panels: training and validation loss, learning rate, tokens per second. Needs matplotlib
    (``pip install mcore-train[plot]``).
    """
    run_dir = Path(run_dir)
    if not (run_dir / METRICS_FILE).is_file():
        raise UserError(f"{run_dir} holds no {METRICS_FILE}; give the directory of an mcore-train run")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("plotting needs matplotlib: pip install 'mcore-train[plot]'") from None

    records = read_metrics(run_dir)
    train = _last_per_step(records, "train")
    evals = _last_per_step(records, "eval")
    if not train:
        raise UserError(f"{run_dir / METRICS_FILE} holds no training records yet")

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    steps = [r["step"] for r in train]
    axes[0].plot(steps, [r["loss"] for r in train], label="train")
    if evals:
        axes[0].plot([r["step"] for r in evals], [r["loss"] for r in evals], "o-", label="validation")
    axes[0].set_title("loss")
    axes[0].legend()
    axes[1].plot(steps, [r["lr"] for r in train])
    axes[1].set_title("learning rate")
    throughput = [(r["step"], r["tokens_per_s"]) for r in train if r.get("tokens_per_s") is not None]
    if throughput:
        axes[2].plot([s for s, _ in throughput], [t for _, t in throughput])
    axes[2].set_title("tokens / s")
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(output) if output is not None else run_dir / PLOT_FILE
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _last_per_step(records: list[dict], kind: str) -> list[dict]:
    """Records of ``kind`` in step order; a step logged again after a resume keeps its latest record."""
    by_step = {r["step"]: r for r in records if r.get("kind") == kind}
    return [by_step[step] for step in sorted(by_step)]
