"""The ``mcore-train plan`` command: memory and predicted step of a config, layout search, GPU calibration."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

from mcore.train.errors import UserError


def add_planner_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--calibration",
        metavar="NAME|FILE.json",
        help="GPU rates for the time prediction: h200-sxm, h100-sxm or a --calibrate file (default: this GPU's model, "
        "else h200-sxm)",
    )
    parser.add_argument(
        "--cluster", metavar="NAME|FILE.json", help="nodes and network: dgx-h100, h200-node or a JSON file"
    )
    parser.add_argument("--search", action="store_true", help="rank every layout on --gpus GPUs by predicted tokens/s")
    parser.add_argument(
        "--gpus", type=int, default=None, metavar="N", help="GPUs: the world size (with --search: the GPUs searched)"
    )
    parser.add_argument("--top", type=int, default=5, metavar="K", help="layouts --search prints (default 5)")
    parser.add_argument("--calibrate", action="store_true", help="measure this machine into a calibration file")
    parser.add_argument("--output", metavar="FILE.json", help="where --calibrate writes (default: calibration.json)")
    parser.add_argument("--dry-run", action="store_true", help="with --calibrate: tiny sizes on the CPU (a test)")


def _network(args: argparse.Namespace):
    import torch

    from mcore.train.planning.calibration import load_calibration
    from mcore.train.planning.cluster import Cluster, Network, load_cluster

    name = args.calibration
    if name is None:
        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else ""
        name = "h100-sxm" if "H100" in gpu else "h200-sxm"
    calibration = load_calibration(name)
    if args.cluster is not None:
        cluster = load_cluster(args.cluster)
        return Network(cluster, calibration if args.calibration else cluster.gpu())
    preset = "dgx-h100" if calibration.name == "h100-sxm" else "h200-node"
    return Network(Cluster(preset, name), calibration) if args.calibration else Network(load_cluster(preset))


def _calibrate(args: argparse.Namespace) -> int:
    from mcore.train.planning.measure import calibrate

    result = calibrate(args.calibration, dry_run=args.dry_run)
    path = args.output or "calibration.json"
    result.save(path)
    top = max(r for _, r in result.gemm["bf16"])
    print(
        f"calibration of {result.name} written to {path}: bf16 GEMM up to {top:.0f} TFLOP/s, copy "
        f"{result.copy_gbps:.0f} GB/s, attention at {int(result.attention[-1][0])} tokens "
        f"{result.attention[-1][1]:.0f} TFLOP/s"
    )
    return 0


def _search(args: argparse.Namespace, config, network, memory: float) -> int:
    from mcore.train.planning.search import format_search, search
    from mcore.train.planning.shape import ModelShape

    gpus = args.gpus or args.world_size
    if gpus is None or gpus < 1:
        raise UserError(f"--search needs --gpus N >= 1, got {gpus}")
    shape = ModelShape.from_config(config.model)
    found = search(shape, gpus, config.train.global_batch_size, config.data.seq_length, network, memory)
    if args.json:
        rows = [
            {
                "overrides": c.layout.overrides(),
                "memory_gb": c.memory_gb,
                "tokens_per_s": c.prediction.tokens_per_s if c.runs else None,
                "mfu": c.prediction.mfu if c.runs else None,
                "reasons": list(c.reasons),
            }
            for c in found
        ]
        print(json.dumps(rows, indent=1))
    else:
        print(format_search(found, args.top))
    return 0


def _world_size(args: argparse.Namespace) -> int | None:
    """``--world-size``, or ``--gpus`` (the same thing without --search); both given must agree."""
    gpus, world = getattr(args, "gpus", None), args.world_size
    if gpus is not None and world is not None and gpus != world:
        raise UserError(f"--gpus {gpus} and --world-size {world} disagree: give one of them (both mean the world size)")
    return world if world is not None else gpus


def run_plan(args: argparse.Namespace, load: Callable) -> int:
    """``mcore-train plan`` with parsed ``args``; ``load(args)`` gives the config."""
    from mcore.train.plan import default_world_size, make_plan
    from mcore.train.plan_report import format_plan, plan_to_dict

    if args.calibrate:
        return _calibrate(args)
    config = load(args)
    network = _network(args)
    memory = args.gpu_memory if args.gpu_memory is not None else network.gpu.memory_gb
    if memory <= 0:
        raise UserError(f"--gpu-memory must be > 0 GB, got {memory}")
    if args.search:
        return _search(args, config, network, memory)
    world = _world_size(args) or default_world_size(config)
    if world < 1:
        raise UserError(f"--world-size must be >= 1, got {world}")
    plan = make_plan(config, world, memory, network)
    print(json.dumps(plan_to_dict(plan), indent=1) if args.json else format_plan(plan))
    return 0


def memory_warning(config, world_size: int, gpu_memory_gb: float | None = None) -> str | None:
    """A line saying that ``config`` will not fit the GPU, with the plan's cheapest memory mode that does, or
    ``None`` (it fits, there is no GPU to compare with, or the layout is invalid: training reports that itself)."""
    from mcore.train.plan import make_plan

    if gpu_memory_gb is None:
        import torch

        if not torch.cuda.is_available() or config.train.device == "cpu":
            return None
        gpu_memory_gb = torch.cuda.get_device_properties(0).total_memory / 1e9
    try:
        plan = make_plan(config, world_size, gpu_memory_gb)
    except UserError:
        return None
    if plan.fits:
        return None
    worst = plan.worst
    text = (
        f"mcore-train plan estimates {worst.total / 1e9:.1f} GB on pipeline rank {worst.pp_rank}, more than the "
        f"{gpu_memory_gb:.0f} GB of this GPU; "
    )
    best = plan.suggestion
    if best is None:
        return text + "no memory mode fits: raise parallel.tp / parallel.pp or lower train.micro_batch_size"
    return text + f"the cheapest mode that fits is {best.name} ({best.worst_gb:.1f} GB): {' '.join(best.overrides)}"
