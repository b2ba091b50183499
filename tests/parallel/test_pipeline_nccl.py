"""The pipeline schedules over NCCL on GPUs: the same parity cases as the gloo tests, one GPU per rank.

NCCL matches point-to-point messages strictly in order and a send waits for its receive, so this is where a
communication plan that only works thanks to gloo's buffering would hang. The cross entropy runs on its torch
reference (``MCORE_KERNELS_BACKEND=reference``) so that this test is about the pipeline only.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import traceback

import pytest
import torch
import torch.distributed as dist

from tests.parallel.test_pipeline_parity import STEPS, _check, _run_case

pytestmark = pytest.mark.multigpu


def _entry(rank: int, world: int, init_file: str, queue) -> None:
    os.environ["MCORE_KERNELS_BACKEND"] = "reference"
    try:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
        queue.put((rank, True, _cases(rank, world)))
    except BaseException:  # noqa: BLE001 - reported to the parent with its traceback
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _cases(rank: int, world: int) -> dict:
    from mcore.parallel.grid import ParallelConfig, build_process_groups
    from mcore.parallel.pipeline import GPipe, Interleaved1F1B, OneFOneB, ZeroBubbleH1

    device = torch.device("cuda", rank)
    out = {}
    full = build_process_groups(ParallelConfig(pp=world))
    for cls in (GPipe, OneFOneB, ZeroBubbleH1):
        for m in (1, world, 3 * world + 1):
            out[f"pp{world}-{cls.name}-m{m}"] = _run_case(full, cls, m, device=device)
    for m in (world, 2 * world):
        out[f"pp{world}-interleaved-m{m}"] = _run_case(full, Interleaved1F1B, m, vpp=2, device=device)
    out[f"pp{world}-1f1b-variable-shapes"] = _run_case(full, OneFOneB, 5, variable_shapes=True, device=device)
    if world % 2 == 0 and world > 2:
        half = build_process_groups(ParallelConfig(pp=2))  # two stages: prev == next for the interleaved ring
        for cls, vpp, m in ((Interleaved1F1B, 2, 6), (ZeroBubbleH1, 1, 7), (OneFOneB, 1, 7)):
            out[f"pp2dp{world // 2}-{cls.name}-m{m}"] = _run_case(half, cls, m, vpp=vpp, ddp=True, device=device)
    return out


@pytest.fixture(scope="module")
def nccl_results():
    world = min(torch.cuda.device_count(), 4)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    fd, init_file = tempfile.mkstemp(prefix="mcore_nccl_")
    os.close(fd)
    os.unlink(init_file)
    procs = [ctx.Process(target=_entry, args=(r, world, init_file, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results, failures = {}, {}
    for _ in range(world):
        rank, ok, value = queue.get(timeout=600)
        (results if ok else failures)[rank] = value
    for p in procs:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
    if os.path.exists(init_file):
        os.unlink(init_file)
    assert not failures, "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
    return [results[r] for r in range(world)]


def test_every_schedule_matches_single_process_over_nccl(nccl_results):
    for case in nccl_results[0]:
        _check(nccl_results, case)
    assert len(nccl_results[0]) >= 9, f"expected every schedule to run, got {sorted(nccl_results[0])} ({STEPS} steps)"
