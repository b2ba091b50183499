"""Python API for framework users: load Hugging Face weights into an mcore model, export a model or checkpoint.

model = GPTModel(config, groups=groups, layer_range=(0, 16))   # any tp, any pipeline stage
load_hf_into(model, "meta-llama/Llama-3.2-1B")                 # each rank loads its own slices
export_hf(model, "out/")                                       # whole model in one process
export_hf("runs/x/checkpoints", "out/")                        # any checkpoint, any layout
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from mcore.bridge.bitnet_packing import PackedSources, is_packed_config
from mcore.bridge.config_translation import hf_to_mcore
from mcore.bridge.conversion_plan import plan_import
from mcore.bridge.convert import ConversionResult, McoreToHF, assets_dir, convert
from mcore.bridge.dtypes import parse_dtype_choice, parse_size
from mcore.bridge.errors import BridgeError
from mcore.bridge.hf import CONFIG_FILE, read_hf_dir
from mcore.bridge.mappings import family_for_hf_config
from mcore.bridge.safetensors_io import read_tensor
from mcore.bridge.sources import check_destination, resolve_source, staged_directory
from mcore.bridge.transforms import to_mcore
from mcore.models.config import TransformerConfig
from mcore.parallel.param_attrs import is_tensor_parallel, tp_split, vocab_padding
from mcore.train.checkpoint import expected_model_tensors
from mcore.train.checkpoint.format import tensor_meta_of

# fields that do not change what the weights compute, so a model may differ from config.json in them
_LOAD_IGNORED_FIELDS = ("make_vocab_size_divisible_by", "initializer_range")


def _tp(model: torch.nn.Module) -> tuple[int, int]:
    groups = getattr(model, "groups", None)
    return (groups.tp_rank, groups.tp_size) if groups is not None else (0, 1)


def _local_slice(full: torch.Tensor, param: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's part of ``full``: each partition block split evenly over TP (docs/architecture.md)."""
    split = tp_split(param)
    if tp_size == 1 or split is None:
        return full
    dim = split.dim
    blocks = split.blocks or (full.shape[dim],)
    pieces, offset = [], 0
    for block in blocks:
        chunk = block // tp_size
        pieces.append(full.narrow(dim, offset + tp_rank * chunk, chunk))
        offset += block
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)


def load_hf_into(model: torch.nn.Module, path: str | os.PathLike, *, check_config: bool = True) -> list[str]:
    """Copy the weights of a Hugging Face model (directory or hub id) into ``model``, a ``GPTModel`` at any TP size
    and any pipeline stage; returns the names of the parameters loaded.

    Every parameter of ``model`` must be found; the HF directory is validated as a whole (no missing, extra or
    mis-shaped tensor) and, with ``check_config``, its config must describe the same model as ``model.config``.
    Tensors are read one at a time; padding rows of the vocabulary are zero.
    """
    config = getattr(model, "config", None)
    if not isinstance(config, TransformerConfig):
        raise TypeError(f"load_hf_into expects an mcore GPTModel (with a TransformerConfig .config), got {type(model)}")
    source = resolve_source(path)
    if source.kind != "hf":
        raise BridgeError(f"{path} is an mcore checkpoint; load_hf_into reads Hugging Face models")
    hf = read_hf_dir(source.path)
    where = str(source.path / CONFIG_FILE)
    family = family_for_hf_config(hf.config, where)
    hf_config = hf_to_mcore(hf.config, family, where)
    if check_config:
        ours, theirs = config.to_dict(), hf_config.to_dict()
        differ = [k for k in ours if k not in _LOAD_IGNORED_FIELDS and ours[k] != theirs[k]]
        if differ:
            detail = ", ".join(f"{k}: model {ours[k]!r} vs config.json {theirs[k]!r}" for k in differ)
            raise BridgeError(f"{where} describes another model than model.config ({detail})")
    packed = PackedSources(hf.tensors, str(source.path)) if is_packed_config(hf.config) else None
    tensors = hf.tensors if packed is None else packed.view  # packed BitNet linears read unpacked
    plan = plan_import(family, hf_config, tensors, expected_model_tensors(hf_config), None, str(source.path))
    steps = {s.mcore: s for s in plan.steps}
    params = dict(model.named_parameters())
    unknown = [n for n in params if n not in steps]
    if unknown:
        raise BridgeError(f"model parameters {unknown[:4]} have no counterpart in {source.path}")
    tp_rank, tp_size = _tp(model)
    heads = {"num_heads": config.num_attention_heads, "num_kv_heads": config.num_key_value_heads}
    with torch.no_grad():
        for name, param in params.items():
            step = steps[name]
            inputs = [read_tensor(e) if packed is None else packed.read(h, e) for h, e in _sources(plan, step)]
            padded = None
            if vocab_padding(param) is not None:
                padded = param.shape[0] * (tp_size if is_tensor_parallel(param) else 1)
            full = to_mcore(step.op, inputs, head_dim=config.head_dim, padded_rows=padded, **heads)
            local = _local_slice(full, param, tp_rank, tp_size)
            if local.shape != param.shape:
                raise BridgeError(
                    f"{name}: HF weights give a local shape {list(local.shape)}, the model has {list(param.shape)}"
                )
            param.copy_(local)
    return list(params)


def _sources(plan, step):
    return [(h, plan.sources[h]) for h in step.hf]


def _full_model_tensors(model: torch.nn.Module, config: TransformerConfig) -> dict[str, torch.Tensor]:
    expected = expected_model_tensors(config)
    params = dict(model.named_parameters())
    whole = _tp(model)[1] == 1 and list(params) == list(expected)
    if not whole or any(tuple(params[n].shape) != expected[n].shape for n in expected):
        raise BridgeError(
            "export_hf(model) needs the whole model in one process (tp=1, every layer); for a TP shard or a "
            "pipeline stage, save a checkpoint with mcore-train and call export_hf(checkpoint_dir, path)"
        )
    return params


def export_hf(
    model_or_checkpoint: torch.nn.Module | str | os.PathLike,
    path: str | os.PathLike,
    *,
    dtype: str = "keep",
    max_shard_size: str | int = "5GB",
    overwrite: bool = False,
    hf_assets: str | os.PathLike | None = None,
    progress: bool | None = False,
    bitnet_packed: bool | None = None,
) -> ConversionResult:
    """Write a Hugging Face directory from an mcore ``GPTModel`` (whole, in this process) or an mcore checkpoint
    (any tp/pp, model-only or training). ``hf_assets``: an HF directory whose ``config.json`` extras and tokenizer
    files are written along (a checkpoint converted by the bridge carries its own). ``bitnet_packed`` (a bitnet
    model): write HF's packed ternary weights (``True``) or plain ones (``False``); ``None``: as the HF files
    the model came from (a checkpoint always follows the files it was converted from)."""
    if not isinstance(model_or_checkpoint, torch.nn.Module):
        return convert(
            model_or_checkpoint,
            path,
            to="hf",
            dtype=dtype,
            max_shard_size=max_shard_size,
            overwrite=overwrite,
            progress=progress,
            hf_assets=hf_assets,
        )
    model = model_or_checkpoint
    config = getattr(model, "config", None)
    if not isinstance(config, TransformerConfig):
        raise TypeError(f"export_hf expects a GPTModel or a checkpoint path, got {type(model).__name__}")
    params = _full_model_tensors(model, config)
    saved = {name: tensor_meta_of(p, tp_size=1) for name, p in params.items()}

    def read_full(name: str) -> torch.Tensor:
        tensor, meta = params[name].detach().cpu(), saved[name]
        if meta.vocab_padded_dim is not None:
            tensor = tensor.narrow(meta.vocab_padded_dim, 0, meta.vocab_size)
        return tensor

    dst = Path(path).expanduser()
    check_destination(dst, overwrite, [])
    job = McoreToHF(
        config,
        saved,
        read_full,
        where="model",
        target_dtype=parse_dtype_choice(dtype),
        max_shard_bytes=parse_size(max_shard_size),
        assets=assets_dir(hf_assets),
        bitnet_packed=bitnet_packed,
    )
    with staged_directory(dst, overwrite) as staged:
        count = job.write(staged, progress)
    return ConversionResult("mcore->hf", Path("<model>"), dst, job.plan.family.name, count, job.total_bytes, job.notes)
