"""Golden loss curves: 20 fp32 CPU steps of each family's tiny preset and of the demo, as torchtitan keeps them.

Recorded once (``python -m tests.golden.curves --write``) before a refactor of the model or the training path,
and checked by ``tests/test_golden_curves.py`` ever after: exact on the platform that wrote them (same torch,
Python and machine), 1e-6 relative elsewhere (other BLAS builds reorder float sums).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).parent
STEPS = 20
# Every run is fp32 on CPU, one process, the embedded corpus and byte tokenizer (no downloads).
COMMON = [
    "train.device=cpu",
    "train.precision=fp32",
    f"train.steps={STEPS}",
    "log.interval=1",
    "train.eval_interval=0",
    "train.sample_tokens=0",
    "train.hang_timeout=0",
    "log.plot=false",
    "log.tensorboard=false",
    "log.progress_bar=false",
    "log.straggler_interval=0",
]
TINY = ["data.seq_length=32", "train.global_batch_size=4", "train.micro_batch_size=2", "lr.warmup_steps=2"]
# name -> overrides; "demo" is the embedded default itself (hidden 128, 4 layers), shortened to 20 steps.
RUNS: dict[str, list[str]] = {
    "demo": [],
    "llama": ["model=llama-tiny", *TINY],
    "qwen2": ["model=qwen2-tiny", *TINY],
    "qwen3": ["model=qwen3-tiny", *TINY],
    "mistral": ["model=mistral-tiny", *TINY],
}


def platform_key() -> str:
    """What must match for the curves to be bitwise reproducible: torch, Python, the machine and the vector ISA
    torch's CPU kernels dispatch to (an AVX2 and an AVX-512 machine sum fp32 differently: the curves recorded on
    2026-12-01 differ in the 8th digit at step 11 on an AVX2 EPYC). Recordings whose key lacks the ISA (the first
    ones) are compared to 1e-6 everywhere."""
    isa = torch.backends.cpu.get_cpu_capability()
    return f"torch {torch.__version__} | python {platform.python_version()} | {platform.machine()} | {isa}"


def train_curve(name: str) -> list[float]:
    """Train run ``name`` for ``STEPS`` steps in this process; the per-step training losses."""
    import io

    from mcore.train.config import load_config
    from mcore.train.loop import run_training
    from mcore.train.runtime import init_runtime

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        config = load_config(None, [*COMMON, *RUNS[name], f"log.run_dir={tmp}/run"])
        runtime = init_runtime(config)
        run_training(config, runtime, stream=io.StringIO())
        losses: dict[int, float] = {}
        for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines():
            record = json.loads(line)
            if record["kind"] == "train":
                losses[record["step"]] = record["loss"]
    if sorted(losses) != list(range(1, STEPS + 1)):
        raise RuntimeError(f"golden run {name!r} logged steps {sorted(losses)}, expected 1..{STEPS}")
    return [losses[s] for s in range(1, STEPS + 1)]


def path_of(name: str) -> Path:
    return HERE / f"{name}.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write", action="store_true", help="record the curves (overwrites)")
    parser.add_argument("names", nargs="*", default=list(RUNS))
    args = parser.parse_args(argv)
    for name in args.names:
        curve = train_curve(name)
        record = {"name": name, "overrides": RUNS[name], "platform": platform_key(), "losses": curve}
        print(name, curve[0], curve[-1])
        if args.write:
            path_of(name).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
