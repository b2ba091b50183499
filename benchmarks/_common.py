"""Shared machinery of the training benchmarks: run specs, the measuring worker, launching, loss-curve checks.

The three benchmark scripts follow one pattern. An orchestrator (no GPU work of its own) validates the run
specs of its configurations, writes them to ``<work>/plan.json`` and launches workers, each configuration (or, in
dry runs, a group of configurations sharing a world size) in its own process group:
``python -m torch.distributed.run --standalone --nproc-per-node N <script> --worker ...`` (a plain
``python <script> --worker ...`` for one process), all output appended to one log. A worker builds the run
exactly like ``mcore-train`` does (``load_config`` -> ``init_runtime`` -> ``Trainer``, mock data through
``build_run_data`` and ``microbatch_stream``), times ``Trainer.train_step`` over micro-batches already on the
device, and rank 0 writes ``<work>/configs/<name>.json``. The orchestrator compares the loss curves and rewrites
its few output files after every launch (a device call returns at most 8 files, and a call cut short returns
what is there).

Timing follows ``hf_baseline.py``: the wall time of the first step (synchronized), then the median of per-step
CUDA-event times over the steps after the warm-up (on CPU ``time.perf_counter``); with several ranks each
step's time is the slowest rank's. Peak memory is ``torch.cuda.max_memory_allocated`` since just before the
first step (the maximum over ranks); on CPU the process's peak RSS, which cannot be reset (dry runs only).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]


def shared_bench(name: str) -> Path:
    """``bench/<name>`` of the shared folder: ``../shared`` beside the checkout (the dev machine's), or ``shared/``
    inside it (the GPU machine's copy of the checkout); the first path when neither holds it."""
    homes = (REPO_ROOT.parent / "shared", REPO_ROOT / "shared")
    return next((p / "bench" / name for p in homes if (p / "bench" / name).is_file()), homes[0] / "bench" / name)


DEFAULT_HF_BASELINE = shared_bench("hf_baseline.py")

# NVLink SHARP / multicast stay off on the lent machines (see the device notes); every multi-GPU child gets these.
NVLS_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

SHAPES: dict[str, dict[str, int]] = {
    # hf_baseline.py's shapes, number for number (Llama layers, untied embeddings)
    "1b": {"hidden": 2048, "layers": 16, "heads": 16, "kv": 8, "ffn": 8192, "vocab": 32000, "seq": 4096, "mbs": 4},
    "8b4l": {"hidden": 4096, "layers": 4, "heads": 32, "kv": 8, "ffn": 14336, "vocab": 128256, "seq": 4096, "mbs": 2},
    # not in hf_baseline.py: a small shape for fp32 smoke runs on the GPU, and the CPU dry-run shape
    "small": {"hidden": 512, "layers": 4, "heads": 8, "kv": 4, "ffn": 1408, "vocab": 32000, "seq": 512, "mbs": 2},
    "tiny": {"hidden": 64, "layers": 2, "heads": 4, "kv": 2, "ffn": 176, "vocab": 300, "seq": 64, "mbs": 2},
}

# Overrides every benchmark run shares: mock tokens, no evaluation, nothing printed or plotted by the loop.
BENCH_OVERRIDES = (
    "data.mock=true",
    "train.eval_interval=0",
    "train.sample_tokens=0",
    "train.hang_timeout=0",
    "log.progress_bar=false",
    "log.tensorboard=false",
    "log.plot=false",
    "log.straggler_interval=0",
    "log.gpu_stats_interval=0",
)


def llama_model(shape: Mapping[str, int], **fields: Any) -> dict[str, Any]:
    """The ``model`` config section of a Llama of ``shape`` (a ``SHAPES`` entry), with Hugging Face
    ``LlamaConfig``'s defaults for everything the shape leaves open (what ``hf_baseline.py`` trains)."""
    missing = [k for k in ("hidden", "layers", "heads", "kv", "ffn", "vocab", "seq") if k not in shape]
    if missing:
        raise ValueError(f"shape {dict(shape)} lacks {missing}; expected the keys of a SHAPES entry")
    model = {
        "model_type": "llama",
        "hidden_size": shape["hidden"],
        "num_hidden_layers": shape["layers"],
        "num_attention_heads": shape["heads"],
        "num_key_value_heads": shape["kv"],
        "intermediate_size": shape["ffn"],
        "vocab_size": shape["vocab"],
        "max_position_embeddings": shape["seq"],
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
    }
    model.update(fields)
    return model


# ----------------------------------------------------------------------------------------------- run specs
@dataclass
class RunSpec:
    """One benchmark configuration: how many ranks, the mcore-train config, and what to do besides stepping.

    ``overrides`` are ``mcore-train`` ``a.b=c`` overrides applied on top of ``model`` (the model section).
    ``untimed_steps`` leading steps (the first included) are left out of the median step time. ``save_at``
    saves a full checkpoint into ``ckpt_dir`` after that step; ``resume_from`` starts from a full checkpoint
    (any layout), continuing its step, data position and optimizer. ``stop_after`` ends the run after that
    global step (``train.steps`` still fixes the LR schedule and the data, so a shorter run sees the same).
    ``profile_steps`` more steps after the measured ones run under the CUDA profiler (``step_profile.py``); they
    are not timed, and their breakdown goes into the result as ``profile``.
    """

    name: str
    world_size: int
    overrides: list[str]
    model: dict[str, Any]
    untimed_steps: int = 1
    save_at: int | None = None
    ckpt_dir: str | None = None
    resume_from: str | None = None
    stop_after: int | None = None
    profile_steps: int = 0

    def __post_init__(self) -> None:
        if not self.name or not all(c.isalnum() or c in "-_." for c in self.name):
            raise ValueError(f"RunSpec.name must be a non-empty [A-Za-z0-9._-] string, got {self.name!r}")
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"RunSpec.world_size must be an int >= 1, got {self.world_size!r}")
        if not isinstance(self.overrides, list) or not all(isinstance(o, str) and "=" in o for o in self.overrides):
            raise TypeError(f"RunSpec.overrides must be a list of 'a.b=c' strings, got {self.overrides!r}")
        if not isinstance(self.model, dict):
            raise TypeError(f"RunSpec.model must be a dict (the model config section), got {type(self.model).__name__}")
        if not isinstance(self.untimed_steps, int) or self.untimed_steps < 1:
            raise ValueError(f"RunSpec.untimed_steps must be an int >= 1 (the first step), got {self.untimed_steps!r}")
        if (self.save_at is None) != (self.ckpt_dir is None):
            raise ValueError(
                f"RunSpec {self.name}: save_at and ckpt_dir go together, got save_at={self.save_at!r}, "
                f"ckpt_dir={self.ckpt_dir!r}"
            )
        if self.save_at is not None and self.save_at < 1:
            raise ValueError(f"RunSpec {self.name}: save_at must be a step >= 1, got {self.save_at}")
        if not isinstance(self.profile_steps, int) or self.profile_steps < 0:
            raise ValueError(f"RunSpec {self.name}: profile_steps must be an int >= 0, got {self.profile_steps!r}")
        if self.stop_after is not None and self.stop_after < 1:
            raise ValueError(f"RunSpec {self.name}: stop_after must be a step >= 1, got {self.stop_after}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunSpec:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"RunSpec: unknown field(s) {unknown}; known: {sorted(known)}")
        return cls(**data)


def spec_config(spec: RunSpec) -> Any:
    """The validated ``mcore.train`` config of ``spec`` (what its workers will build)."""
    from mcore.train.config import load_config

    return load_config(None, [*BENCH_OVERRIDES, *spec.overrides], default_model=spec.model)


def check_spec(spec: RunSpec) -> Any:
    """Validate ``spec`` before any process starts: its config, its layout on ``spec.world_size`` ranks, the
    micro-batch split and the pipeline schedule's constraints (GPU time is too dear to find these out there).

    Returns the config; raises ``ValueError`` naming the configuration and the problem.
    """
    from mcore.parallel.grid import ParallelConfig
    from mcore.train.errors import UserError
    from mcore.train.trainer import schedule_class

    try:
        config = spec_config(spec)
        p = config.parallel
        layout = ParallelConfig(tp=p.tp, pp=p.pp, vpp=p.vpp, dp=p.dp).resolve(spec.world_size)
        schedule_class(config).check_sizes(layout.pp, p.vpp, config.num_microbatches(layout.dp))
    except (ValueError, TypeError, UserError) as exc:
        raise ValueError(f"configuration {spec.name} is invalid: {exc}") from None
    return config


def write_plan(work_dir: Path, specs: Sequence[RunSpec]) -> Path:
    """Write the specs the workers read (``<work_dir>/plan.json``)."""
    path = work_dir / "plan.json"
    write_json(path, {"specs": [s.to_dict() for s in specs]})
    return path


def read_plan(path: Path, names: Sequence[str]) -> list[RunSpec]:
    """The specs called ``names`` from a plan file, in that order."""
    specs = {d["name"]: RunSpec.from_dict(d) for d in json.loads(Path(path).read_text())["specs"]}
    unknown = [n for n in names if n not in specs]
    if unknown:
        raise ValueError(f"plan {path} has no configuration(s) {unknown}; it has {sorted(specs)}")
    return [specs[n] for n in names]


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as JSON atomically (temp file + rename), so readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def result_path(work_dir: Path, name: str) -> Path:
    return work_dir / "configs" / f"{name}.json"


# ----------------------------------------------------------------------------------------------- the worker
def worker_main(plan: Path, names: Sequence[str], work_dir: Path) -> None:
    """Run the configurations ``names`` of ``plan`` one after another in this process group (every rank)."""
    specs = read_plan(plan, names)
    runtimes = []
    # On a failure the process group is not destroyed (see Runtime.shutdown): the exception ends this rank, and
    # the launcher stops the ranks that wait for it.
    for spec in specs:
        result, runtime = run_spec(spec)
        runtimes.append(runtime)
        if runtime.is_logging_rank:
            write_json(result_path(work_dir, spec.name), result)
            print(f"[{spec.name}] {summary_line(result)}", flush=True)
    for runtime in reversed(runtimes):  # only the first runtime created (owns) the process group
        runtime.shutdown()


def run_spec(spec: RunSpec) -> tuple[dict[str, Any], Any]:
    """Build the run of ``spec`` the way ``mcore-train`` does, step it, and measure; collective over the world.

    Returns (the result, for rank 0 to write; the runtime, whose process group the caller shuts down).
    """
    import torch

    config, runtime, trainer, notes = _build_run(spec)
    measured = _train_and_measure(spec, config, runtime, trainer)
    result = _result(spec, config, runtime, trainer, measured, notes)
    del trainer, measured
    gc.collect()
    if runtime.device.type == "cuda":
        torch.cuda.empty_cache()
    runtime.barrier()
    return result, runtime


def _build_run(spec: RunSpec) -> tuple[Any, Any, Any, list[str]]:
    """(config, runtime, trainer, notes) as ``mcore-train`` builds them, resumed from a checkpoint if asked."""
    from mcore.train.runtime import init_runtime
    from mcore.train.start import build_trainer

    config = spec_config(spec)
    runtime = init_runtime(config)
    if runtime.world_size != spec.world_size:
        raise RuntimeError(f"{spec.name} needs {spec.world_size} rank(s) but was launched on {runtime.world_size}")
    built = build_trainer(config, runtime, load=spec.resume_from)
    return config, runtime, built.trainer, built.notes


@dataclass
class _Measured:
    steps: list[int]
    losses: list[float]  # mean over the global batch (all dp replicas)
    grad_norms: list[float]
    step_times_s: list[float]  # the slowest rank's, per step
    first_step_s: float  # wall time of the first step, synchronized (the slowest rank's)
    peak_bytes: list[int]  # per rank, training steps only
    checkpoint: dict[str, Any] | None
    profile: list[dict[str, Any]] | None = None  # per rank, step_profile.breakdown_from_trace


def _train_and_measure(spec: RunSpec, config: Any, runtime: Any, trainer: Any) -> _Measured:
    import torch

    from mcore.train.checkpoint.directory import CheckpointDirectory
    from mcore.train.checkpoint.state import CheckpointSaver
    from mcore.train.config import config_to_dict
    from mcore.train.datasets import build_run_data, microbatch_stream
    from mcore.train.metrics import peak_memory_bytes
    from mcore.train.trainer import microbatch_to_device

    g, device = trainer.groups, runtime.device
    cuda = device.type == "cuda"
    data = build_run_data(config)
    stream = microbatch_stream(
        data.train, config, consumed_samples=trainer.consumed_samples, dp_rank=g.dp_rank, dp_size=g.dp_size
    )
    first, last = trainer.iteration + 1, min(config.train.steps, spec.stop_after or config.train.steps)
    if last < first:
        raise ValueError(f"{spec.name}: nothing to run (starts at step {first}, stop_after={spec.stop_after})")
    if spec.save_at is not None and not first <= spec.save_at <= last:
        raise ValueError(f"{spec.name}: save_at={spec.save_at} lies outside the steps run [{first}, {last}]")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    steps, losses, norms, timers = [], [], [], []
    first_step_s, peak_before_save, checkpoint = math.nan, 0, None
    sync()
    runtime.barrier()
    measured_last = last - spec.profile_steps
    if measured_last < first:
        raise ValueError(
            f"{spec.name}: profile_steps={spec.profile_steps} leaves no measured step in [{first}, {last}]"
        )
    for step in range(first, measured_last + 1):
        micro = [microbatch_to_device(next(stream), device) for _ in range(trainer.num_microbatches)]
        sync()
        t0 = time.perf_counter()
        timer = _StepTimer(cuda)
        out = trainer.train_step(micro)
        timer.stop()
        if step == first:
            sync()
            first_step_s = time.perf_counter() - t0
        steps.append(step)
        losses.append(out.loss.detach().reshape(()).double())
        norms.append(out.grad_norm.detach().reshape(()).double())
        timers.append(timer)
        if step == spec.save_at:
            # The save gathers the optimizer state over dp: its memory is reported apart from the training peak.
            sync()
            peak_before_save = peak_memory_bytes(device)
            t_save = time.perf_counter()
            saver = CheckpointSaver(trainer, CheckpointDirectory(spec.ckpt_dir), keep_last=1, async_save=False)
            saver.save(config_to_dict(config), {"reason": f"benchmark {spec.name}"})
            checkpoint = {"path": str(saver.last_committed), "step": step, "save_s": time.perf_counter() - t_save}
            if cuda:
                checkpoint["save_peak_mem_gb"] = max(_gather(runtime, peak_memory_bytes(device))) / 1e9
                torch.cuda.reset_peak_memory_stats(device)
    sync()
    peak = max(peak_memory_bytes(device), peak_before_save)
    profile = None
    if spec.profile_steps:
        from step_profile import profile_steps

        def profiled_step(step: int) -> None:
            micro = [microbatch_to_device(next(stream), device) for _ in range(trainer.num_microbatches)]
            trainer.train_step(micro)

        profile = profile_steps(profiled_step, range(measured_last + 1, last + 1), sync)
        profile = _gather(runtime, profile)
    # Losses live on the last pipeline stage of every replica: sum over pp, mean over dp x cp (one collective).
    loss_tensor = trainer.reduce_across_stages_and_replicas(torch.stack(losses)) / g.dp_cp_size
    per_rank_times = _gather(runtime, [t.seconds() for t in timers])
    return _Measured(
        steps=steps,
        losses=loss_tensor.cpu().tolist(),
        grad_norms=torch.stack(norms).cpu().tolist(),
        step_times_s=[max(ts[i] for ts in per_rank_times) for i in range(len(steps))],
        first_step_s=max(_gather(runtime, first_step_s)),
        peak_bytes=_gather(runtime, peak),
        checkpoint=checkpoint,
        profile=profile,
    )


def _result(spec: RunSpec, config: Any, runtime: Any, trainer: Any, m: _Measured, notes: list[str]) -> dict:
    """The JSON record of one configuration (the keys of hf_baseline.py's records among them)."""
    import torch

    from mcore.models.accounting import H200_BF16_PEAK_FLOPS, mfu, model_flops_per_token, parameter_counts

    timed = m.step_times_s[spec.untimed_steps :]
    if not timed:
        raise ValueError(
            f"{spec.name}: ran {len(m.steps)} step(s), all untimed (untimed_steps={spec.untimed_steps}); run more"
        )
    g, device = trainer.groups, runtime.device
    step_s = statistics.median(timed)
    seq = config.data.seq_length
    tokens_per_step = config.train.global_batch_size * seq
    tokens_per_s = tokens_per_step / step_s
    flops_per_token = model_flops_per_token(config.model, seq)
    tflops_per_gpu = flops_per_token * tokens_per_s / runtime.world_size / 1e12
    schedule = type(trainer.schedule)
    cuda = device.type == "cuda"
    return {
        "name": spec.name,
        "impl": "mcore",
        "world_size": runtime.world_size,
        "layout": {"tp": g.tp_size, "pp": g.pp_size, "dp": g.dp_size, "vpp": config.parallel.vpp},
        "layers_per_stage": trainer.pipeline_layout,  # None: the even split
        "schedule": schedule.name,
        "num_microbatches": trainer.num_microbatches,
        "bubble_fraction": schedule.bubble_fraction(g.pp_size, config.parallel.vpp, trainer.num_microbatches),
        "sequence_parallel": config.parallel.sequence_parallel,
        "distributed_optimizer": config.parallel.distributed_optimizer,
        "overlap_grad_reduce": config.parallel.overlap_grad_reduce,
        "overlap_param_gather": config.parallel.overlap_param_gather,
        "precision": trainer.precision,
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__,
        "params": parameter_counts(config.model).total,
        "seq_length": seq,
        "micro_batch_size": config.train.micro_batch_size,
        "global_batch_size": config.train.global_batch_size,
        "tokens_per_step": tokens_per_step,
        "steps": m.steps,
        "losses": m.losses,
        "grad_norms": m.grad_norms,
        "final_loss": m.losses[-1],
        "step_times_s": m.step_times_s,
        "untimed_steps": spec.untimed_steps,
        "step_s": step_s,
        "first_step_s": m.first_step_s,
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_gpu": tokens_per_s / runtime.world_size,
        "flops_per_token": flops_per_token,
        "tflops_per_gpu": tflops_per_gpu,
        "peak_flops": H200_BF16_PEAK_FLOPS,
        "mfu": mfu(tokens_per_s, flops_per_token, runtime.world_size, H200_BF16_PEAK_FLOPS),
        "peak_mem_gb": max(m.peak_bytes) / 1e9,
        "peak_mem_gb_per_rank": [p / 1e9 for p in m.peak_bytes],
        "peak_mem_kind": "cuda max_memory_allocated" if cuda else "process peak RSS",
        "checkpoint": m.checkpoint,
        "profile": m.profile,
        "resumed_from": spec.resume_from,
        "notes": notes,
    }


class _StepTimer:
    """Times one step: CUDA events on the GPU (read after the final synchronize), the host clock on CPU."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        if cuda:
            import torch

            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()
            self.t1 = math.nan

    def stop(self) -> None:
        if self.cuda:
            self.end.record()
        else:
            self.t1 = time.perf_counter()

    def seconds(self) -> float:
        return self.start.elapsed_time(self.end) / 1e3 if self.cuda else self.t1 - self.t0


def _gather(runtime: Any, value: Any) -> list[Any]:
    """``value`` of every rank (over the CPU control group), rank order."""
    if not runtime.distributed:
        return [value]
    import torch.distributed as dist

    out: list[Any] = [None] * runtime.world_size
    dist.all_gather_object(out, value, group=runtime.control_group)
    return out


def summary_line(result: Mapping[str, Any]) -> str:
    """One human-readable line of a configuration's result."""
    return (
        f"{result['tokens_per_s']:.4g} tok/s, {result['tflops_per_gpu']:.4g} TFLOP/s/GPU, MFU "
        f"{100 * result['mfu']:.2f}%, peak {result['peak_mem_gb']:.2f} GB, step {1000 * result['step_s']:.1f} ms, "
        f"loss after step {result['steps'][-1]}: {result['final_loss']:.5f}"
    )


# ----------------------------------------------------------------------------------------------- launching
def child_env(*, dry_run: bool) -> dict[str, str]:
    """The environment of every child process: ours, the NVLS switches, and the packages on ``PYTHONPATH``.

    The packages' ``src`` folders go first on ``PYTHONPATH`` so that a checkout works where nothing is
    pip-installed (the GPU machine); dry runs pin one CPU thread per process (many ranks share few cores).
    """
    env = dict(os.environ)
    env.update(NVLS_ENV)
    sources = [str(p) for p in sorted((REPO_ROOT / "packages").glob("*/src"))]
    env["PYTHONPATH"] = os.pathsep.join([*sources, *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONUNBUFFERED"] = "1"  # so that a run cut short still leaves its output in the log
    if dry_run:
        env["OMP_NUM_THREADS"] = "1"
        env.setdefault("CUDA_VISIBLE_DEVICES", "")
    return env


@dataclass
class Launch:
    """One process group started by an orchestrator and how it ended."""

    names: list[str]
    world_size: int
    returncode: int
    seconds: float
    log: str
    tail: str = ""


def launch_workers(
    script: Path,
    world_size: int,
    args: Sequence[str],
    *,
    names: Sequence[str],
    log_path: Path,
    env: Mapping[str, str],
    timeout_s: float,
) -> Launch:
    """Run ``script *args`` on ``world_size`` local ranks (torch's elastic launcher when > 1), its output
    appended to ``log_path`` (one log for all launches: a device call returns only a few files)."""
    if world_size == 1:
        cmd = [sys.executable, str(script), *args]
    else:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}"]
        cmd = [*launcher, str(script), *args]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(log_path, "a") as log:
        log.write(f"===== {', '.join(names)} on {world_size} rank(s)\n$ {' '.join(cmd)}\n")
        log.flush()
        offset = log.tell()
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(env), start_new_session=True, preexec_fn=_end_with_us
        )
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _stop(proc)
            log.write(f"\n[orchestrator] timed out after {timeout_s:.0f} s; stopped\n")
            code = 124
    seconds = time.perf_counter() - start
    tail = ""
    if code:
        with open(log_path, errors="replace") as log:
            log.seek(offset)
            tail = "\n".join(log.read().splitlines()[-40:])
    return Launch(list(names), world_size, code, seconds, str(log_path), tail)


def _end_with_us() -> None:
    """In the child, before it runs: SIGKILL when this orchestrator dies. Its own session keeps it out of signals
    sent to ours, so without this an orchestrator killed by an outer ``timeout`` left its worker holding the GPU
    (seen on the H200, 2026-12-01: 112 GB held through the next benchmark)."""
    from mcore.train.parent_watch import _request_parent_death_signal

    _request_parent_death_signal(signal.SIGKILL)


def _stop(proc: subprocess.Popen) -> None:
    """End a launch we started: SIGTERM to its process group (torch's launcher then stops its workers, which run
    in sessions of their own), SIGKILL to the group if it is still there a minute later."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def report_launch(launch: Launch) -> None:
    """Print how a launch ended (the end of its output when it failed)."""
    status = "ok" if launch.returncode == 0 else f"FAILED (exit {launch.returncode})"
    print(f"  {', '.join(launch.names)}: {status} in {launch.seconds:.1f} s (log: {launch.log})", flush=True)
    if launch.returncode:
        print("    " + launch.tail.replace("\n", "\n    "), flush=True)


def run_one_launch(
    argv: Sequence[str],
    json_path: Path,
    what: str,
    *,
    log: Path,
    env: Mapping[str, str],
    timeout_s: float | None,
    failures: list[str],
) -> dict[str, Any] | None:
    """Launch one single-process run (``argv[0]`` the script) that writes ``json_path``; its parsed result, or None
    with ``what`` and the exit status appended to ``failures`` (a stale file from an earlier call is removed first,
    so a failed run can never be read as a result)."""
    json_path.unlink(missing_ok=True)
    print(f"running {what}", flush=True)
    launch = launch_workers(
        Path(argv[0]), 1, list(argv[1:]), names=[json_path.stem], log_path=log, env=dict(env), timeout_s=timeout_s
    )
    report_launch(launch)
    if launch.returncode == 0 and json_path.is_file():
        return json.loads(json_path.read_text())
    failures.append(f"{what}: exit {launch.returncode} (log {launch.log})")
    return None


def launch_groups(specs: Sequence[RunSpec], *, one_launch: bool) -> list[list[RunSpec]]:
    """Split ``specs`` (in order) into process groups: one per spec, or with ``one_launch`` each run of
    consecutive specs of the same world size shares one (cheap for dry runs)."""
    groups: list[list[RunSpec]] = []
    for spec in specs:
        if one_launch and groups and groups[-1][0].world_size == spec.world_size:
            groups[-1].append(spec)
        else:
            groups.append([spec])
    return groups


def orchestrate(
    script: Path,
    specs: Sequence[RunSpec],
    *,
    work_dir: Path | None,
    log_path: Path,
    one_launch: bool,
    dry_run: bool,
    timeout_s: float,
    publish: Callable[[dict[str, dict[str, Any]], bool], int],
) -> int:
    """Check every spec, then launch the groups of ``specs`` one after another (a failed group does not stop the
    rest). After each launch ``publish(results so far, False)`` rewrites the report, so a device call cut short
    still returns what finished; the return value is ``publish(results, True)``'s (the exit code).

    ``work_dir`` holds the plan and the per-configuration JSON (default: a temporary directory, removed after).
    """
    for spec in specs:
        check_spec(spec)
    own_work = work_dir is None
    work = Path(tempfile.mkdtemp(prefix="mcore-bench-")) if work_dir is None else work_dir
    names = [s.name for s in specs]

    def results() -> dict[str, dict[str, Any]]:
        found = {p.stem: json.loads(p.read_text()) for p in sorted((work / "configs").glob("*.json"))}
        return {n: found[n] for n in names if n in found}

    try:
        plan = write_plan(work, specs)
        for spec in specs:  # a stale result of an earlier run must not stand in for one that fails now
            result_path(work, spec.name).unlink(missing_ok=True)
        env = child_env(dry_run=dry_run)
        for group in launch_groups(specs, one_launch=one_launch):
            group_names = [s.name for s in group]
            args = ["--worker", "--plan", str(plan), "--configs", ",".join(group_names), "--work-dir", str(work)]
            print(f"launching {', '.join(group_names)} on {group[0].world_size} rank(s)", flush=True)
            launch = launch_workers(
                script, group[0].world_size, args, names=group_names, log_path=log_path, env=env, timeout_s=timeout_s
            )
            report_launch(launch)
            publish(results(), False)
        return publish(results(), True)
    finally:
        if own_work:
            shutil.rmtree(work, ignore_errors=True)


def add_orchestrator_arguments(parser: Any, *, dry_run_help: str) -> None:
    """Options shared by the multi-GPU orchestrators (``multi_gpu.py``, ``eight_gpu.py``), worker mode included."""
    import argparse

    parser.add_argument("--precision", choices=["bf16", "fp32"], default=None, help="bf16 (fp32 in dry runs)")
    parser.add_argument("--untimed-steps", type=int, default=None, help="leading steps left out of the timing (3)")
    parser.add_argument("--compare-steps", type=int, default=20, help="steps whose losses must agree (20)")
    parser.add_argument("--rtol", type=float, default=None, help="loss tolerance (bf16 1e-2, fp32 1e-4)")
    parser.add_argument(
        "--one-launch",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run configurations of the same world size in one process group (default: only in dry runs)",
    )
    parser.add_argument("--launch-timeout", type=float, default=600.0, help="seconds per process group (600)")
    parser.add_argument("--dry-run", action="store_true", help=dry_run_help)
    parser.add_argument("--report", type=Path, nargs="+", metavar="DIR", help="only check and report saved results")
    add_worker_arguments(parser)


def resolve_orchestrator_arguments(parser: Any, args: Any, *, steps: int, positive: tuple[str, ...] = ()) -> None:
    """Fill the dry-run-dependent defaults of :func:`add_orchestrator_arguments` and check the step counts."""
    dry = args.dry_run
    if args.precision is None:
        args.precision = "fp32" if dry else "bf16"
    if args.steps is None:
        args.steps = 4 if dry else steps
    if args.untimed_steps is None:
        args.untimed_steps = 1 if dry else 3
    args.one_launch = dry if args.one_launch is None else args.one_launch
    for name in ("steps", "untimed_steps", "compare_steps", *positive):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.untimed_steps >= args.steps:
        parser.error(f"--untimed-steps ({args.untimed_steps}) must be < --steps ({args.steps}) to leave steps to time")


def add_worker_arguments(parser: Any) -> None:
    """The hidden arguments of a script's worker mode (set by :func:`orchestrate`)."""
    import argparse

    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--plan", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--configs", help="comma-separated configuration names (default: all)")
    parser.add_argument(
        "--work-dir", type=Path, help="plan and per-configuration results (default: a temporary directory)"
    )


def default_rtol(precision: str) -> float:
    """The loss-curve tolerance of the issue: bf16 relative 1e-2, fp32 1e-4."""
    tolerances = {"bf16": 1e-2, "fp32": 1e-4}
    if precision not in tolerances:
        raise ValueError(f"no default loss tolerance for precision {precision!r}; expected one of {list(tolerances)}")
    return tolerances[precision]


def parse_names(text: str | None, known: Sequence[str]) -> list[str]:
    """``"a,b"`` -> ``["a", "b"]`` checked against ``known`` (``None``: all of ``known``), in ``known``'s order."""
    if text is None:
        return list(known)
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise SystemExit(f"--configs: unknown or empty {unknown or text!r}; choose from {', '.join(known)}")
    return [n for n in known if n in names]


def load_reported(dirs: Sequence[Path]) -> dict[str, dict[str, Any]]:
    """The configurations in the ``results.json`` of each of ``dirs`` (a later directory wins a name found twice)."""
    results: dict[str, dict[str, Any]] = {}
    for d in dirs:
        path = Path(d) / "results.json"
        if not path.is_file():
            raise SystemExit(f"--report: {path} does not exist (give directories that a run's --out wrote)")
        results.update(json.loads(path.read_text())["configs"])
    return results


def write_report(out_dir: Path, data: Mapping[str, Any], markdown: str) -> None:
    """``results.json`` and ``results.md`` in ``out_dir``."""
    write_json(out_dir / "results.json", data)
    (out_dir / "results.md").write_text(markdown + "\n")


# ----------------------------------------------------------------------------------------------- checking
@dataclass(frozen=True)
class CurveCheck:
    """How one loss curve compares to the reference over their common steps."""

    ok: bool
    rtol: float
    steps: tuple[int, ...]
    max_rel_diff: float
    worst_step: int | None
    problems: tuple[str, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "rtol": self.rtol,
            "steps_compared": len(self.steps),
            "first_step": self.steps[0] if self.steps else None,
            "last_step": self.steps[-1] if self.steps else None,
            "max_rel_diff": self.max_rel_diff,
            "worst_step": self.worst_step,
            "problems": list(self.problems),
        }


def curve(result: Mapping[str, Any]) -> dict[int, float]:
    """``{step: loss}`` of a configuration's result."""
    return dict(zip(result["steps"], result["losses"], strict=True))


def compare_loss_curves(
    reference: Mapping[int, float], candidate: Mapping[int, float], *, rtol: float, max_steps: int | None = None
) -> CurveCheck:
    """Check ``candidate`` against ``reference`` (``{step: loss}``) over their first ``max_steps`` common steps.

    Passes when every loss is finite, ``|candidate - reference| <= rtol * |reference|`` at every step, and the
    candidate follows the reference's trend: wherever the reference moves by more than ``rtol`` (relative) from
    one step to the next, the candidate moves in the same direction. (Two curves can each stay within ``rtol``
    and still move apart by up to ``2 * rtol`` in one step; the trend check catches that.)
    """
    if isinstance(rtol, bool) or not isinstance(rtol, int | float) or not (rtol > 0 and math.isfinite(rtol)):
        raise ValueError(f"rtol must be a finite number > 0, got {rtol!r}")
    if max_steps is not None and (not isinstance(max_steps, int) or max_steps < 1):
        raise ValueError(f"max_steps must be None or an int >= 1, got {max_steps!r}")
    for label, c in (("reference", reference), ("candidate", candidate)):
        if not isinstance(c, Mapping):
            raise TypeError(f"{label} must be a mapping {{step: loss}}, got {type(c).__name__}")
    common = sorted(set(reference) & set(candidate))
    if max_steps is not None:
        common = common[:max_steps]
    problems: list[str] = []
    if not common:
        problems.append(
            f"no common steps (reference has {sorted(reference)[:5]}..., candidate has {sorted(candidate)[:5]}...)"
        )
        return CurveCheck(False, float(rtol), (), math.inf, None, tuple(problems))
    worst, worst_step = 0.0, None
    for step in common:
        r, c = float(reference[step]), float(candidate[step])
        if not (math.isfinite(r) and math.isfinite(c)):
            problems.append(f"step {step}: non-finite loss (reference {r}, candidate {c})")
            worst, worst_step = math.inf, step
            continue
        rel = abs(c - r) / abs(r) if r != 0 else abs(c)
        if rel > worst:
            worst, worst_step = rel, step
        if rel > rtol:
            problems.append(f"step {step}: loss {c:.6g} vs reference {r:.6g} (relative difference {rel:.3g} > {rtol})")
    for prev, step in zip(common, common[1:]):
        r0, r1, c0, c1 = (float(x) for x in (reference[prev], reference[step], candidate[prev], candidate[step]))
        if not all(math.isfinite(x) for x in (r0, r1, c0, c1)):
            continue
        moved = r1 - r0
        if abs(moved) > rtol * abs(r0) and (c1 - c0) * moved <= 0:
            problems.append(
                f"steps {prev}->{step}: reference moves {moved:+.4g}, candidate {c1 - c0:+.4g} (trend differs)"
            )
    return CurveCheck(not problems, float(rtol), tuple(common), worst, worst_step, tuple(problems))


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table; floats get 4 significant digits, ``None`` prints as ``-``."""

    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
