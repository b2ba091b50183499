"""The ``mcore-train`` command (also ``python -m mcore.train``).

::

    mcore-train [--config FILE.yaml] [--load CKPT] [key=value ...]      train (no arguments: the embedded demo)
    mcore-train --nproc-per-node N [--max-restarts R] ...                 N local workers (torch elastic)
    mcore-train evaluate [--config FILE.yaml] --load CKPT [key=value ...] validation loss/perplexity as JSON
    mcore-train config [--config FILE.yaml] [key=value ...]                every key (type, default, help); with a
                                                                          config or overrides, the resolved YAML
    mcore-train plan [--config FILE.yaml] [--world-size N] [--gpu-memory GB] [--calibration C] [key=value ...]
    mcore-train plan --search --gpus N [--cluster NAME|FILE.json] [key=value ...]   best layouts on N GPUs
    mcore-train plan --calibrate [--output FILE.json]                     measure this GPU for the planner
    mcore-train plot RUN_DIR
    mcore-train preprocess --input DOCS.jsonl --output-prefix PREFIX [--tokenizer NAME]

A bad input (config key, value, file, checkpoint) prints one line ``mcore-train: error: ...`` on stderr
and exits with code 2; ``--debug`` adds the traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import traceback
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from mcore.train import __version__
from mcore.train.errors import UserError
from mcore.train.log_setup import configure_logging

COMMANDS = ("train", "evaluate", "config", "plan", "plot", "preprocess")
# The command table of the module docstring, shown by --help.
OVERVIEW = __doc__.split("::\n\n", 1)[1].split("\n\n", 1)[0]


def _common(parser: argparse.ArgumentParser, *, overrides: bool = True) -> None:
    parser.add_argument("--config", metavar="FILE.yaml", help="YAML config file (default: the embedded demo)")
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    if overrides:
        parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. train.steps=50")


def build_parser(command: str) -> argparse.ArgumentParser:
    """The argument parser of one sub-command."""
    prog = "mcore-train" if command == "train" else f"mcore-train {command}"
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Train GPT models with mcore (tensor, pipeline and data parallelism).\n\n" + OVERVIEW
        if command == "train"
        else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    if command == "train":
        _common(parser)
        parser.add_argument("--load", metavar="CKPT", help="checkpoint to start from (same as checkpoint.load=CKPT)")
        parser.add_argument(
            "--nproc-per-node", type=int, default=None, metavar="N", help="launch N local workers (torch elastic)"
        )
        parser.add_argument(
            "--max-restarts",
            type=int,
            default=0,
            metavar="R",
            help="restart the workers up to R times after a failure; each restart resumes from the last checkpoint",
        )
        parser.add_argument("--version", action="version", version=f"mcore-train {__version__}")
    elif command == "evaluate":
        _common(parser)
        parser.add_argument("--load", metavar="CKPT", required=True, help="checkpoint to evaluate")
    elif command == "config":
        _common(parser)
    elif command == "plan":
        _common(parser)
        parser.add_argument("--world-size", type=int, default=None, help="ranks (default: tp x pp x dp of the config)")
        parser.add_argument(
            "--gpu-memory",
            type=float,
            default=None,
            metavar="GB",
            help="GPU memory to fit in (default: the calibration's)",
        )
        parser.add_argument("--json", action="store_true", help="print the plan as JSON")
        from mcore.train.plan_cli import add_planner_arguments

        add_planner_arguments(parser)
    elif command == "plot":
        parser.add_argument("run_dir", metavar="RUN_DIR", help="directory of a run (holds metrics.jsonl)")
        parser.add_argument("--output", metavar="FILE.png", help="where to write (default: RUN_DIR/curves.png)")
        parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    elif command == "preprocess":
        from mcore.train.preprocess import add_preprocess_arguments

        add_preprocess_arguments(parser)
        parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    return parser


# ------------------------------------------------------------------------------------------------ commands
def _config(args: argparse.Namespace, extra: list[str] | None = None, *, reuse_run_config: bool = False):
    """(config, overrides, checkpoint): the run's config and the ``--load`` / ``checkpoint.load`` checkpoint,
    opened once here (``None`` without one; the caller closes it). With a checkpoint and no model in the config,
    the checkpoint's model is used; with ``reuse_run_config`` (evaluate) and no ``--config``, the checkpoint's
    whole training config is."""
    from mcore.train.checkpoint.reader import CheckpointReader
    from mcore.train.config import load_config, parse_overrides

    overrides = list(getattr(args, "overrides", []) or []) + (extra or [])
    load = getattr(args, "load", None)
    for key, value in parse_overrides(overrides):
        if key == "checkpoint.load":
            load = str(value)
    reader = CheckpointReader(load) if load else None
    try:
        model = reader.model_config_dict if reader is not None else None
        train_config = reader.train_config if reader is not None else None
        if reuse_run_config and args.config is None and train_config is not None:
            base = {k: v for k, v in train_config.items() if k not in ("checkpoint", "log")}
            return load_config(None, overrides, base=base), overrides, reader
        return load_config(args.config, overrides, default_model=model), overrides, reader
    except BaseException:
        if reader is not None:
            reader.close()
        raise


def _train(args: argparse.Namespace) -> int:
    from mcore.train.output_paths import check_train_outputs
    from mcore.train.parent_watch import end_with_launcher

    end_with_launcher()  # a worker of `--nproc-per-node` ends when its launcher dies
    if args.nproc_per_node is not None and args.nproc_per_node < 1:
        raise UserError(f"--nproc-per-node must be >= 1, got {args.nproc_per_node}")
    extra = [f"checkpoint.load={args.load}"] if args.load else []
    config, overrides, checkpoint = _config(args, extra)
    with contextlib.ExitStack() as stack:
        if checkpoint is not None:
            stack.callback(checkpoint.close)
        check_train_outputs(config)  # before building anything: an unwritable output fails in one line
        return _run_or_launch(args, config, overrides, checkpoint)


def _run_or_launch(args: argparse.Namespace, config, overrides: list[str], checkpoint) -> int:
    from mcore.train.run_lock import run_dir_lock

    nproc = args.nproc_per_node
    if nproc is not None or args.max_restarts > 0:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise UserError("--nproc-per-node is for launching; this process is already one of several workers")
        from mcore.parallel.grid import ParallelConfig
        from mcore.train.checkpoint.directory import CheckpointDirectory
        from mcore.train.launcher import launch_local

        try:  # fail here, before any worker starts, when the layout cannot fit the local workers
            layout = ParallelConfig(
                tp=config.parallel.tp,
                pp=config.parallel.pp,
                vpp=config.parallel.vpp,
                dp=config.parallel.dp,
                ep=config.parallel.ep,
                etp=config.parallel.etp,
                cp=config.parallel.cp,
            ).resolve(nproc or 1)
        except ValueError as exc:
            raise UserError(f"parallel layout does not fit {nproc or 1} worker(s): {exc}") from None
        config.num_microbatches(layout.dp)
        run_dir = config.log.run_dir or os.path.join("runs", datetime.now().strftime("%Y%m%d-%H%M%S"))
        worker_args = (["--config", args.config] if args.config else []) + (["--debug"] if args.debug else [])
        worker_args += [*overrides, f"log.run_dir={run_dir}"]
        checkpoint_dir = Path(config.checkpoint.dir or os.path.join(run_dir, "checkpoints"))
        CheckpointDirectory(checkpoint_dir).latest()  # a broken `latest` fails here, not once in every worker
        with run_dir_lock(run_dir):  # held for the workers, which recognise their launcher's lock
            print(f"mcore-train: launching {nproc or 1} worker(s), run directory {run_dir}", flush=True)
            return launch_local(nproc or 1, worker_args, max_restarts=args.max_restarts, checkpoint_dir=checkpoint_dir)

    from mcore.train.loop import resolve_run_dir, run_training
    from mcore.train.plan_cli import memory_warning
    from mcore.train.runtime import init_runtime

    if os.environ.get("RANK", "0") == "0":  # before the model is built: a run that will not fit says so
        warning = memory_warning(config, int(os.environ.get("WORLD_SIZE", "1")))
        if warning:
            print(f"mcore-train: warning: {warning}", file=sys.stderr, flush=True)
    with init_runtime(config) as runtime:
        config.log.run_dir = str(resolve_run_dir(config, runtime))  # fixed once: the lock and the run agree
        with run_dir_lock(config.log.run_dir, enabled=runtime.is_logging_rank):
            run_training(config, runtime, load=checkpoint)
    return 0


def _evaluate(args: argparse.Namespace) -> int:
    from mcore.train.checkpoint.reader import resolve_checkpoint_dir
    from mcore.train.evaluate import run_evaluation
    from mcore.train.runtime import init_runtime

    config, overrides, checkpoint = _config(args, reuse_run_config=True)  # --load is required: never None
    with contextlib.closing(checkpoint):
        if args.config is None and checkpoint.train_config is None and not _names_data(overrides):
            raise UserError(
                f"checkpoint {checkpoint.path} holds no training config (a converted or model-only checkpoint), so "
                "nothing says what to evaluate it on: give the data, e.g. data.path=PREFIX data.tokenizer=NAME "
                "(the tokenizer the model was trained with), or --config FILE.yaml"
            )
        same = checkpoint.path == resolve_checkpoint_dir(args.load)  # else checkpoint.load= named another
        with init_runtime(config) as runtime:
            result = run_evaluation(config, runtime, checkpoint if same else args.load)
    if runtime.is_logging_rank:
        print(json.dumps(result), flush=True)
    return 0


def _names_data(overrides: list[str]) -> bool:
    """Whether the overrides say which tokens to read (the rest of ``data`` does not choose the corpus)."""
    return any(item.partition("=")[0].strip() in ("data.path", "data.mock", "data.tokenizer") for item in overrides)


def _show_config(args: argparse.Namespace) -> int:
    if args.config is None and not args.overrides:
        from mcore.train.config_help import config_keys, format_config_keys

        print(format_config_keys(config_keys()))
        return 0
    from mcore.train.config import dump_config

    config, _, checkpoint = _config(args)
    if checkpoint is not None:
        checkpoint.close()
    print(dump_config(config), end="")
    return 0


def _plan(args: argparse.Namespace) -> int:
    from mcore.train.plan_cli import run_plan

    def load(parsed: argparse.Namespace):
        config, _, checkpoint = _config(parsed)
        if checkpoint is not None:
            checkpoint.close()
        return config

    return run_plan(args, load)


def _plot(args: argparse.Namespace) -> int:
    from mcore.train.plot import plot_run

    print(plot_run(args.run_dir, args.output))
    return 0


def _preprocess(args: argparse.Namespace) -> int:
    from mcore.train.preprocess import run_preprocess

    return run_preprocess(args)


HANDLERS: dict[str, Callable[[argparse.Namespace], int]] = {
    "train": _train,
    "evaluate": _evaluate,
    "config": _show_config,
    "plan": _plan,
    "plot": _plot,
    "preprocess": _preprocess,
}


def main(argv: list[str] | None = None) -> int:
    """Run ``mcore-train`` with ``argv`` (default ``sys.argv[1:]``); return the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = "train"
    if argv and argv[0] in COMMANDS:
        command = argv.pop(0)
    args = build_parser(command).parse_intermixed_args(argv)
    debug = bool(getattr(args, "debug", False)) or os.environ.get("MCORE_DEBUG") == "1"
    configure_logging()
    try:
        return HANDLERS[command](args)
    except UserError as exc:
        if debug:
            traceback.print_exc()
        world = int(os.environ.get("WORLD_SIZE", "1"))
        where = f"[rank {os.environ.get('RANK', '0')}] " if world > 1 else ""
        print(f"mcore-train: error: {where}{exc}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        print("mcore-train: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
