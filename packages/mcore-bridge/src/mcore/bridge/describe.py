"""``mcore-bridge inspect``: what a Hugging Face directory or an mcore checkpoint holds, from headers only."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mcore.bridge.config_translation import carried_keys
from mcore.bridge.convert import HF_SIDECAR
from mcore.bridge.dtypes import torch_dtype_from_name, torch_dtype_name
from mcore.bridge.errors import BridgeError
from mcore.bridge.hf import read_hf_dir
from mcore.bridge.mappings import FAMILIES, family_for_hf_config
from mcore.bridge.safetensors_io import read_header
from mcore.bridge.sources import resolve_source
from mcore.train.checkpoint import CheckpointError, CheckpointReader


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: list[int]
    nbytes: int


@dataclass
class Description:
    """What ``inspect`` reports about one path."""

    kind: str  # "hf" or "mcore"
    path: str
    family: str  # a supported family, or "unsupported: <architecture>"
    layout: str
    config: dict[str, Any]
    tensors: list[TensorInfo]
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["total_bytes"] = self.total_bytes
        out["num_parameters"] = sum(_numel(t.shape) for t in self.tensors)
        return out

    def format(self) -> str:
        params = sum(_numel(t.shape) for t in self.tensors)
        lines = [
            f"path:       {self.path}",
            f"kind:       {'Hugging Face' if self.kind == 'hf' else 'mcore checkpoint'}",
            f"family:     {self.family}",
            f"layout:     {self.layout}",
            f"tensors:    {len(self.tensors)}, {params:,} parameters, {_human(self.total_bytes)}",
        ]
        lines += [f"{k + ':':<11} {v}" for k, v in self.details.items()]
        lines.append("config:")
        lines += [f"  {k}: {json.dumps(v)}" for k, v in self.config.items()]
        name_width = max((len(t.name) for t in self.tensors), default=4)
        lines.append(f"{'name':<{name_width}}  {'dtype':<9} {'shape':<16} size")
        lines += [f"{t.name:<{name_width}}  {t.dtype:<9} {str(t.shape):<16} {_human(t.nbytes)}" for t in self.tensors]
        return "\n".join(lines)


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _human(nbytes: int) -> str:
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{nbytes} B"
        size /= 1024
    raise AssertionError("unreachable")


def describe(path: str | os.PathLike) -> Description:
    """Describe an HF directory (or hub id) or an mcore checkpoint, reading headers and metadata only."""
    source = resolve_source(path)
    if source.kind == "hf":
        return _describe_hf(source.path)
    try:
        return _describe_mcore(source.path)
    except CheckpointError as exc:
        raise BridgeError(str(exc)) from None


def _describe_hf(path: Path) -> Description:
    hf = read_hf_dir(path)
    details: dict[str, Any] = {}
    try:
        family = family_for_hf_config(hf.config)
        family_name = family.name
        details["carried"] = ", ".join(carried_keys(hf.config, family)) or "(none)"
    except BridgeError:
        family_name = f"unsupported: {hf.config.get('architectures') or hf.config.get('model_type')}"
    details["side files"] = ", ".join(f.name for f in hf.side_files) or "(none)"
    if hf.skipped:
        details["not carried"] = "; ".join(hf.skipped)
    tensors = [TensorInfo(e.name, torch_dtype_name(e.dtype), list(e.shape), e.nbytes) for e in hf.tensors.values()]
    files = hf.weight_files
    layout = f"Hugging Face safetensors, {len(files)} file(s): {', '.join(f.name for f in files)}"
    return Description("hf", str(path), family_name, layout, hf.config, tensors, details)


def damaged_files(checkpoint: Path) -> tuple[list[str], int]:
    """(one line per damaged safetensors file of an mcore checkpoint, number of files checked).

    Each file's header is parsed and checked against the file size (offsets tile the data, nothing missing or
    extra), so a truncated or overwritten shard is found without reading the tensors.
    """
    files = sorted(checkpoint.glob("*/*.safetensors"))
    problems = []
    for file in files:
        try:
            read_header(file)
        except BridgeError as exc:
            problems.append(str(exc))
    return problems, len(files)


def _describe_mcore(path: Path) -> Description:
    with CheckpointReader(path) as reader:
        problems, checked = damaged_files(reader.path)
        if problems:
            raise BridgeError(
                f"{reader.path} is a damaged checkpoint: {len(problems)} of its {checked} tensor files fail "
                f"validation: {'; '.join(problems)}. Use another checkpoint (e.g. an older iter_* beside it)"
            )
        config = reader.model_config_dict
        tensors, details = [], {}
        for name in reader.tensor_names():
            meta = reader.tensor_meta(name)
            nbytes = _numel(list(meta.shape)) * torch_dtype_from_name(meta.dtype).itemsize
            tensors.append(TensorInfo(name, meta.dtype, list(meta.shape), nbytes))
            if meta.vocab_padded_dim is not None and "vocab" not in details:
                details["vocab"] = f"{meta.vocab_size} rows, padded to {meta.shape[meta.vocab_padded_dim]}"
        model_type = config.get("model_type")
        family = model_type if model_type in FAMILIES else f"unsupported: {model_type}"
        details["iteration"] = reader.iteration
        details["contents"] = "model and optimizer state (training)" if reader.has_optimizer_state else "model only"
        sidecar = reader.path / HF_SIDECAR
        details["hf files"] = ", ".join(sorted(p.name for p in sidecar.iterdir())) if sidecar.is_dir() else "(none)"
        lay = reader.layout
        layout = f"mcore tp={lay.tp} pp={lay.pp} vpp={lay.vpp} dp={lay.dp}"
        return Description("mcore", str(reader.path), family, layout, config, tensors, details)
