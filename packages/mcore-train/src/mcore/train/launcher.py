"""``mcore-train --nproc-per-node N``: start N local workers through torch's elastic launcher.

This is what ``torchrun --standalone --nproc-per-node N -m mcore.train ...`` does: a c10d rendezvous on
localhost, one ``python -m mcore.train`` process per rank with ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` and
``MASTER_ADDR``/``MASTER_PORT`` set, and up to ``max_restarts`` restarts of the whole group when a
worker dies. The run directory is fixed here, before the first start, so that restarted workers find
the run's ``checkpoints/latest`` and resume from it.
"""

from __future__ import annotations

import os
import sys
import uuid

from mcore.train.errors import UserError


def launch_local(nproc_per_node: int, worker_args: list[str], *, max_restarts: int = 0) -> int:
    """Run ``python -m mcore.train *worker_args`` on ``nproc_per_node`` local ranks; return an exit code.

    ``worker_args`` must already fix ``log.run_dir`` when restarts should resume (the CLI does this).
    """
    if nproc_per_node < 1:
        raise UserError(f"--nproc-per-node must be >= 1, got {nproc_per_node}")
    if max_restarts < 0:
        raise UserError(f"--max-restarts must be >= 0, got {max_restarts}")
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

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
    try:
        elastic_launch(config, sys.executable)("-m", "mcore.train", *worker_args)
    except ChildFailedError as exc:
        failures = exc.failures
        first = min(failures)
        info = failures[first]
        codes = ", ".join(f"rank {r}: exit {f.exitcode}" for r, f in sorted(failures.items()))
        print(f"mcore-train: {len(failures)} worker(s) failed ({codes})", file=sys.stderr)
        code = info.exitcode
        return code if isinstance(code, int) and 0 < code < 256 else 1
    return 0
