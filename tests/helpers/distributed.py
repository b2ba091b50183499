"""Spawn N gloo workers once and run many test cases inside them.

Spawning costs about a second per process on 2 cores, so a test module starts its workers once
(a module-scoped fixture) and runs every case of that world size in the same process groups::

    def _cases(rank, world_size):          # module-level, so that spawn can pickle it
        out = {}
        out["tp2"] = check_tp2(...)        # any picklable value
        return out

    @pytest.fixture(scope="module")
    def results():
        return run_workers(4, _cases)      # list, one entry per rank

A worker that raises makes ``run_workers`` raise ``WorkerError`` carrying every failed rank's traceback.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import tempfile
import traceback
from collections.abc import Callable
from typing import Any


class WorkerError(RuntimeError):
    pass


def _entry(rank: int, world_size: int, init_file: str, fn: Callable, args: tuple, queue) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
        # pickled to bytes here: a tensor put on the queue as is travels as shared memory that this process
        # serves, and a rank that exits before the parent reads its result leaves a dangling handle
        # (FileNotFoundError in the parent's get)
        result = pickle.dumps(fn(rank, world_size, *args))
        queue.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - reported to the parent with its traceback
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_workers(world_size: int, fn: Callable, *args: Any, timeout: float = 900.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the per-rank results."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    fd, init_file = tempfile.mkstemp(prefix="mcore_dist_")
    os.close(fd)
    os.unlink(init_file)
    procs = [ctx.Process(target=_entry, args=(r, world_size, init_file, fn, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    try:
        for _ in range(world_size):
            rank, ok, value = queue.get(timeout=timeout)
            (results if ok else failures)[rank] = pickle.loads(value) if ok else value  # our own workers' bytes
            if failures:
                break
    except Exception as exc:  # queue.Empty: some rank hung
        failures[-1] = (
            f"timed out after {timeout:.0f}s waiting for workers ({exc!r}); finished ranks: {sorted(results)}"
        )
    finally:
        for p in procs:
            p.join(timeout=5 if failures else 60)
            if p.is_alive():
                p.kill()
        if os.path.exists(init_file):
            os.unlink(init_file)
    if failures:
        msg = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
        raise WorkerError(f"{len(failures)} worker(s) failed:\n{msg}")
    return [results[r] for r in range(world_size)]
