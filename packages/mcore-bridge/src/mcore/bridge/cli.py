"""The ``mcore-bridge`` command: ``convert``, ``verify``, ``inspect`` and ``list``.

Bad input ends with one line, ``mcore-bridge: error: <what was expected, what was found, the fix>``, and exit
status 2; a ``verify`` that finds the models disagree exits with status 1.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from mcore.bridge.dtypes import DTYPE_CHOICES
from mcore.bridge.errors import BridgeError

EXIT_OK, EXIT_MISMATCH, EXIT_BAD_INPUT = 0, 1, 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mcore-bridge", description="Streaming, lossless Hugging Face <-> mcore checkpoint conversion."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{convert,verify,inspect,list}")

    p = sub.add_parser("convert", help="convert HF <-> mcore (direction detected from SRC)")
    p.add_argument("src", metavar="SRC", help="HF directory, HF hub id (owner/name[@revision]) or mcore checkpoint")
    p.add_argument("dst", metavar="DST", help="directory to create")
    p.add_argument("--to", choices=["mcore", "hf"], help="expected direction (checked against SRC)")
    p.add_argument("--dtype", choices=list(DTYPE_CHOICES), default="keep", help="dtype of floating tensors")
    p.add_argument("--max-shard-size", default="5GB", help="largest HF safetensors shard (default 5GB)")
    p.add_argument("--overwrite", action="store_true", help="replace DST if it exists (only once complete)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument(
        "--hf-assets",
        metavar="DIR",
        help="mcore -> hf: HF directory whose config.json extras and tokenizer files to write along "
        "(for checkpoints that carry none, e.g. saved by training)",
    )
    p.add_argument(
        "--bitnet-packed",
        choices=["yes", "no"],
        help="mcore -> hf of a bitnet model: write HF's packed ternary weights (2 bits each + weight_scale) or plain "
        "ones (default: as the HF files it was converted from)",
    )
    p.add_argument(
        "--fp8-blocks",
        action="store_true",
        help="mcore -> hf: linear weights in DeepSeek's block-wise FP8 (e4m3 + weight_scale_inv per 128x128 block)",
    )

    p.add_argument(
        "--quantize",
        choices=["mxfp4"],
        help="mcore -> hf: write GPT-OSS's expert weights in MXFP4 (as the released checkpoints; an MXFP4 source "
        "comes back bit-exact)",
    )

    p = sub.add_parser("verify", help="run the HF and the mcore model on the same tokens and compare")
    p.add_argument("hf", metavar="HF", help="HF directory or hub id")
    p.add_argument("mcore", metavar="MCORE", help="mcore checkpoint")
    p.add_argument("--tokens", type=int, default=64, help="number of random tokens (default 64)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--seed", type=int, default=0, help="seed of the random tokens")
    p.add_argument("--rtol", type=float, help="allowed difference relative to each tensor's largest |value| (1e-4)")
    p.add_argument("--max-kl", type=float, help="allowed mean KL divergence per token (1e-6)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")

    p = sub.add_parser("inspect", help="describe an HF directory or an mcore checkpoint")
    p.add_argument("path", metavar="PATH", help="HF directory, hub id or mcore checkpoint")
    p.add_argument("--json", action="store_true", help="print the description as JSON")

    sub.add_parser("list", help="list the supported model families")
    return parser


def _convert(args: argparse.Namespace) -> int:
    from mcore.bridge.convert import convert

    result = convert(
        args.src,
        args.dst,
        to=args.to,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        overwrite=args.overwrite,
        progress=False if args.no_progress else None,
        fp8_blocks=args.fp8_blocks,
        hf_assets=args.hf_assets,
        bitnet_packed=None if args.bitnet_packed is None else args.bitnet_packed == "yes",
        quantize=args.quantize,
    )
    print(
        f"{result.direction}: {result.family}, {result.tensors} tensors, {result.bytes_written / 2**20:.1f} MiB "
        f"written to {result.destination}"
    )
    return EXIT_OK


def _verify(args: argparse.Namespace) -> int:
    from mcore.bridge.verify import verify

    tolerances = {k: v for k, v in (("rtol", args.rtol), ("max_kl", args.max_kl)) if v is not None}
    report = verify(args.hf, args.mcore, tokens=args.tokens, device=args.device, seed=args.seed, **tolerances)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.format())
    return EXIT_OK if report.passed else EXIT_MISMATCH


def _inspect(args: argparse.Namespace) -> int:
    from mcore.bridge.describe import describe

    description = describe(args.path)
    print(json.dumps(description.to_dict(), indent=2) if args.json else description.format())
    return EXIT_OK


def _list(args: argparse.Namespace) -> int:
    from mcore.bridge.mappings import FAMILIES

    width = max(len(f.name) for f in FAMILIES.values())
    for family in FAMILIES.values():
        print(f"{family.name:<{width}}  {', '.join(family.hf_architectures):<20}  {family.description}")
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    args = _parser().parse_args(argv)
    logging.basicConfig(format="mcore-bridge: %(message)s", level=logging.WARNING)
    commands = {"convert": _convert, "verify": _verify, "inspect": _inspect, "list": _list}
    try:
        return commands[args.command](args)
    except BridgeError as exc:
        print(f"mcore-bridge: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BrokenPipeError:  # output piped into e.g. `head`, which closed early: not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
