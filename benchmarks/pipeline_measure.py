"""Measure each schedule's per-stage idle time on real processes (CPU/gloo or CUDA/NCCL).

``python benchmarks/pipeline_measure.py --pp 4 --microbatches 8`` spawns ``pp`` ranks, runs every schedule
with ``measure=True`` on a synthetic stack of ``x + fc2(tanh(fc1(x)))`` blocks built from the tensor-parallel
linears (so ZB-H1 can split their backward; F, B and W then each cost two GEMMs), and prints the measured idle
fraction of every stage next to the theoretical one. Times come from the schedules' own accounting
(``PipelineSchedule.last_timeline``): ``time.perf_counter`` around each op, after a CUDA synchronize on GPUs.
"""

from __future__ import annotations

import argparse
import os
import queue as queue_module
import statistics
import tempfile
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from mcore.parallel.pipeline.schedules import (
    GPipe,
    Interleaved1F1B,
    NoPipelining,
    OneFOneB,
    PipelineSchedule,
    ZeroBubbleH1,
)
from mcore.parallel.pipeline.timeline import StageTimeline
from mcore.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear

SCHEDULES: tuple[type[PipelineSchedule], ...] = (NoPipelining, GPipe, OneFOneB, Interleaved1F1B, ZeroBubbleH1)

__all__ = ["MeasureConfig", "measure", "main"]


@dataclass(frozen=True)
class MeasureConfig:
    """Sizes of the synthetic workload and of the measurement."""

    hidden: int = 256
    ffn: int = 1024
    seq: int = 128
    micro_batch: int = 2
    layers_per_chunk: int = 2
    runs: int = 3  # measured runs per schedule, after one unmeasured warm-up run

    def __post_init__(self) -> None:
        for name in ("hidden", "ffn", "seq", "micro_batch", "layers_per_chunk", "runs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MeasureConfig.{name} must be an int >= 1, got {value!r}")


class _Block(nn.Module):
    def __init__(self, cfg: MeasureConfig, device: torch.device) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(cfg.hidden, cfg.ffn, device=device)
        self.fc2 = RowParallelLinear(cfg.ffn, cfg.hidden, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


def _measure_rank(
    schedule_cls: type[PipelineSchedule], group, vpp: int, m: int, cfg: MeasureConfig, device: torch.device
) -> list[StageTimeline]:
    chunks = [nn.Sequential(*[_Block(cfg, device) for _ in range(cfg.layers_per_chunk)]).to(device) for _ in range(vpp)]
    shape = (cfg.seq, cfg.micro_batch, cfg.hidden)
    schedule = schedule_cls(
        chunks, num_microbatches=m, pp_group=group, activation_shape=shape, device=device, measure=True
    )
    g = torch.Generator(device=device).manual_seed(0)
    inputs = [torch.randn(shape, generator=g, device=device) for _ in range(m)]
    last = group is None or dist.get_rank(group) == dist.get_world_size(group) - 1

    def forward_step(chunk_index: int, x: torch.Tensor | None, mb: torch.Tensor) -> torch.Tensor:
        y = chunks[chunk_index](mb if x is None else x)
        return y.square().mean() if last and chunk_index == vpp - 1 else y

    timelines = []
    for run in range(cfg.runs + 1):
        schedule.run(forward_step, inputs)
        for chunk in chunks:
            chunk.zero_grad(set_to_none=True)
        if run > 0:
            timelines.append(schedule.last_timeline)
    return timelines


def _worker(rank: int, world: int, init_file: str, jobs: list, cfg: MeasureConfig, cuda: bool, queue) -> None:
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    try:
        group = dist.new_group(list(range(world)))
        results = {}
        for name, vpp, m in jobs:
            cls = next((c for c in SCHEDULES if c.__name__ == name), None)
            if cls is None:
                raise ValueError(f"unknown schedule {name!r}; known: {', '.join(c.__name__ for c in SCHEDULES)}")
            results[(name, vpp, m)] = _measure_rank(cls, group, vpp, m, cfg, device)
    except BaseException:
        # Report and leave the process group alone: destroying NCCL communicators waits on the peers, which may
        # be blocked on this rank; the parent stops them.
        queue.put((rank, None, traceback.format_exc()))
        raise
    queue.put((rank, results, None))
    dist.destroy_process_group()


def _collect(procs: list, queue, poll_s: float = 0.5) -> dict[int, dict]:
    """Every rank's results; on a rank's failure (an exception, or an exit without results) stop the others
    and raise with what it reported, instead of waiting for results that will never come."""
    per_rank: dict[int, dict] = {}
    while len(per_rank) < len(procs):
        try:
            rank, results, error = queue.get(timeout=poll_s)
        except queue_module.Empty:
            dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in per_rank]
            if not dead:
                continue
            rank, results, error = dead[0][0], None, f"exited with code {dead[0][1]} without reporting"
        if error is not None:
            for p in procs:
                if p.is_alive():
                    p.terminate()
            for p in procs:
                p.join()
            raise RuntimeError(f"pipeline measurement: rank {rank} failed:\n{error}")
        per_rank[rank] = results
    return per_rank


def measure(
    pp: int, jobs: list[tuple[str, int, int]], cfg: MeasureConfig | None = None, *, cuda: bool = False
) -> dict[tuple[str, int, int], list[list[StageTimeline]]]:
    """Run ``jobs`` (schedule class name, vpp, micro-batches) on ``pp`` spawned ranks.

    Returns, per job, one list per measured run holding every stage's timeline.
    """
    cfg = cfg or MeasureConfig()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    fd, init_file = tempfile.mkstemp(prefix="mcore_pp_measure_")
    os.close(fd)
    os.unlink(init_file)
    procs = [ctx.Process(target=_worker, args=(r, pp, init_file, jobs, cfg, cuda, queue)) for r in range(pp)]
    for p in procs:
        p.start()
    try:
        per_rank = _collect(procs, queue)
        for p in procs:
            p.join()
    finally:
        if os.path.exists(init_file):
            os.unlink(init_file)
    return {job: [[per_rank[r][job][run] for r in range(pp)] for run in range(cfg.runs)] for job in jobs}


def _common_span_idle(stages: list[StageTimeline]) -> list[float]:
    """Each stage's idle share of the pipeline's common span (first start to last end over all stages)."""
    start = min(t.start for t in stages)
    end = max(t.end for t in stages)
    return [1.0 - t.busy / (end - start) for t in stages]


def _mean_op_ms(runs: list[list[StageTimeline]]) -> str:
    """Mean duration of each op kind over all stages and runs, in milliseconds (``-`` where absent)."""
    by_kind: dict[str, list[float]] = {}
    for stages in runs:
        for tl in stages:
            for t in tl.ops:
                by_kind.setdefault(t.op.kind, []).append(t.end - t.start)
    return "/".join(f"{1e3 * statistics.mean(by_kind[k]):.2f}" if k in by_kind else "-" for k in "FBW")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--vpp", type=int, default=2, help="model chunks per rank for Interleaved1F1B")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[8])
    parser.add_argument("--cuda", action="store_true", help="one GPU per rank, NCCL")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=MeasureConfig.hidden)
    parser.add_argument("--ffn", type=int, default=MeasureConfig.ffn)
    parser.add_argument("--seq", type=int, default=MeasureConfig.seq)
    parser.add_argument("--layers-per-chunk", type=int, default=MeasureConfig.layers_per_chunk)
    args = parser.parse_args(argv)
    cfg = MeasureConfig(
        hidden=args.hidden, ffn=args.ffn, seq=args.seq, layers_per_chunk=args.layers_per_chunk, runs=args.runs
    )
    jobs = [
        (cls.__name__, args.vpp if cls is Interleaved1F1B else 1, m)
        for m in args.microbatches
        for cls in SCHEDULES
        if cls is not NoPipelining
    ]
    results = measure(args.pp, jobs, cfg, cuda=args.cuda)
    print("| schedule | pp | vpp | m | bubble (formula) | idle (measured, median) | per stage | mean F/B/W ms |")
    print("|---|---|---|---|---|---|---|---|")
    for (name, vpp, m), runs in results.items():
        cls = next(c for c in SCHEDULES if c.__name__ == name)
        per_run = [_common_span_idle(stages) for stages in runs]
        overall = statistics.median(sum(r) / len(r) for r in per_run)
        stages = " ".join(f"{statistics.median(r[s] for r in per_run):.3f}" for s in range(args.pp))
        formula = cls.bubble_fraction(args.pp, vpp, m)
        ms = _mean_op_ms(runs)
        print(f"| {name} | {args.pp} | {vpp} | {m} | {formula:.3f} | {overall:.3f} | {stages} | {ms} |")


if __name__ == "__main__":
    main()
