"""``mcore-train --nproc-per-node N``: start N local workers through torch's elastic launcher.

This is what ``torchrun --standalone --nproc-per-node N -m mcore.train ...`` does: a c10d rendezvous on
localhost, one ``python -m mcore.train`` process per rank with ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` and
``MASTER_ADDR``/``MASTER_PORT`` set, and up to ``max_restarts`` restarts of the whole group when a
worker dies. The run directory is fixed here, before the first start, so that restarted workers find
the run's ``checkpoints/latest`` and resume from it.

A SIGTERM/SIGINT to the launcher (a preemption) is forwarded to the workers, which save a checkpoint and
exit; the launcher waits for them (``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds at most, default 30; torch
before 2.12 fixes 30) and exits
0 with one line naming that checkpoint. The workers end with the launcher if it is killed outright
(:mod:`mcore.train.parent_watch`).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
import uuid
from pathlib import Path

from mcore.train.checkpoint.format import LATEST_FILE
from mcore.train.errors import UserError
from mcore.train.parent_watch import LAUNCHER_PID_ENV


def stop_report(signum: int, checkpoint_dir: Path | None, since: float) -> tuple[int, str]:
    """(exit code, line) after the workers were stopped by ``signum``: 0 when they saved a checkpoint since
    ``since`` (a ``time.time()``), else ``128 + signum``."""
    name = signal.Signals(signum).name
    saved = None
    if checkpoint_dir is not None:
        try:
            ckpt = checkpoint_dir / (checkpoint_dir / LATEST_FILE).read_text(encoding="utf-8").strip()
            state_file = ckpt / "train_state.json"
            state = json.loads(state_file.read_text(encoding="utf-8"))
            if state.get("reason") == "stop" and state_file.stat().st_mtime >= since:
                saved = (ckpt, state.get("iteration"))
        except (OSError, ValueError):
            saved = None
    if saved is not None:
        step = f" (step {saved[1]})" if saved[1] is not None else ""
        return (
            0,
            f"mcore-train: stopped by {name}; checkpoint {saved[0]}{step} saved; the same command resumes from it",
        )
    return 128 + signum, f"mcore-train: stopped by {name} before the workers saved a checkpoint; nothing new was saved"


def _quiet_elastic_warnings() -> None:
    """torch elastic logs each signal it sends as a warning; our own lines say what happened (errors stay)."""
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.ERROR)


def launch_local(
    nproc_per_node: int, worker_args: list[str], *, max_restarts: int = 0, checkpoint_dir: Path | None = None
) -> int:
    """Run ``python -m mcore.train *worker_args`` on ``nproc_per_node`` local ranks; return an exit code.

    ``worker_args`` must already fix ``log.run_dir`` when restarts should resume (the CLI does this);
    ``checkpoint_dir`` is where the workers save, named in the line printed after a SIGTERM.
    """
    if nproc_per_node < 1:
        raise UserError(f"--nproc-per-node must be >= 1, got {nproc_per_node}")
    if max_restarts < 0:
        raise UserError(f"--max-restarts must be >= 0, got {max_restarts}")
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    _quiet_elastic_warnings()
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc_per_node,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=max_restarts,
        monitor_interval=0.5,
        start_method="spawn",
    )
    # The workers inherit our environment; keep CPU threads per rank sensible on shared machines.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # The c10d rendezvous shares one TCPStore across restart rounds, so restarted workers can read the
    # dead workers' gloo/NCCL addresses from it and hang while connecting; a store per round avoids that.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())  # the workers end with this process
    started = time.time()
    try:
        elastic_launch(config, sys.executable)("-m", "mcore.train", *worker_args)
    except SignalException as exc:  # forwarded to the workers, which saved and exited (or were killed)
        code, line = stop_report(int(exc.sigval), checkpoint_dir, started)
        print(line, file=sys.stdout if code == 0 else sys.stderr, flush=True)
        return code
    except ChildFailedError as exc:
        failures = exc.failures
        first = min(failures)
        info = failures[first]
        codes = ", ".join(f"rank {r}: exit {f.exitcode}" for r, f in sorted(failures.items()))
        print(f"mcore-train: {len(failures)} worker(s) failed ({codes})", file=sys.stderr)
        code = info.exitcode
        return code if isinstance(code, int) and 0 < code < 256 else 1
    return 0
