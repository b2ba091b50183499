"""GPU readings (power, clocks, temperature, memory, utilization) and the per-rank straggler report."""

from __future__ import annotations

import statistics
from typing import Any

import torch
import torch.distributed as dist


def read_gpu_stats(device: torch.device) -> dict[str, float]:
    """This rank's GPU readings through NVML (``torch.cuda`` wraps nvidia-ml-py); empty off CUDA or without NVML."""
    if device.type != "cuda":
        return {}
    stats: dict[str, float] = {}
    readers = {
        "power_w": lambda: torch.cuda.power_draw(device) / 1000.0,
        "sm_clock_mhz": lambda: float(torch.cuda.clock_rate(device)),
        "temperature_c": lambda: float(torch.cuda.temperature(device)),
        "utilization_pct": lambda: float(torch.cuda.utilization(device)),
    }
    for key, read in readers.items():
        try:
            stats[key] = float(read())
        except Exception:  # noqa: BLE001 - NVML missing or unsupported on this GPU: skip that reading
            continue
    free, total = torch.cuda.mem_get_info(device)
    stats["memory_used_gb"] = (total - free) / 1e9
    stats["memory_total_gb"] = total / 1e9
    return stats


def gather_gpu_stats(device: torch.device, group: dist.ProcessGroup | None, world_size: int) -> list[dict[str, float]]:
    """Every rank's readings, on every rank (collective over ``group`` when distributed)."""
    mine = read_gpu_stats(device)
    if world_size == 1:
        return [mine]
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, mine, group=group)
    return out


def straggler_report(step_times: list[float], data_times: list[float], threshold: float = 1.10) -> dict[str, Any]:
    """Summarise per-rank mean step and data-loading times; ranks over ``threshold`` x the median are flagged."""
    median = statistics.median(step_times)
    slowest = max(range(len(step_times)), key=step_times.__getitem__)
    flagged = [r for r, t in enumerate(step_times) if median > 0 and t > threshold * median]
    return {
        "median_step_s": median,
        "slowest_rank": slowest,
        "slowest_step_s": step_times[slowest],
        "slowest_data_s": data_times[slowest],
        "stragglers": flagged,
    }


def gather_step_times(
    step_time: float, data_time: float, group: dist.ProcessGroup | None, world_size: int
) -> tuple[list[float], list[float]]:
    """Every rank's (mean step time, mean data time) over the last interval (collective over ``group``)."""
    local = torch.tensor([step_time, data_time], dtype=torch.float64)
    if world_size == 1:
        return [step_time], [data_time]
    out = [torch.zeros(2, dtype=torch.float64) for _ in range(world_size)]
    dist.all_gather(out, local, group=group)
    return [float(t[0]) for t in out], [float(t[1]) for t in out]
