"""Streaming conversion between Hugging Face directories and mcore checkpoints (the ``convert`` command).

Both directions follow the same shape: *prepare* reads only headers and metadata and validates everything (family,
config, every tensor name, shape and dtype), then *write* streams one output tensor at a time into a staged
directory that replaces DST only when complete. No model is instantiated (the expected parameters come from a
model on the ``meta`` device) and no GPU is used. Peak memory is that of one fused tensor and its inputs.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mcore.bridge import mxfp4
from mcore.bridge.bitnet_packing import (
    OFFLINE_CONFIG,
    SCALE_SUFFIX,
    PackedSources,
    is_packed_config,
    is_packed_name,
    packed_outputs,
    quantize_weight,
)
from mcore.bridge.config_translation import hf_to_mcore, mcore_to_hf
from mcore.bridge.conversion_plan import ExportPlan, ImportPlan, plan_export, plan_import
from mcore.bridge.dtypes import parse_dtype_choice, parse_size, torch_dtype_from_name, torch_dtype_name
from mcore.bridge.errors import BridgeError
from mcore.bridge.fp8_blocks import SCALE_SUFFIX as FP8_SCALE_SUFFIX
from mcore.bridge.fp8_blocks import (
    SCALES_FILE,
    BlockFormat,
    Fp8Source,
    block_format,
    fp8_specs,
    is_projection,
    load_scales,
    quantize_blocks,
    save_scales,
    without_quantization_config,
)
from mcore.bridge.hf import (
    CONFIG_FILE,
    HFWriter,
    copy_side_files,
    list_side_files,
    read_config,
    read_hf_dir,
    write_config,
)
from mcore.bridge.mappings import family_by_name, family_for_hf_config
from mcore.bridge.memory import release_freed_memory
from mcore.bridge.progress import Progress
from mcore.bridge.safetensors_io import TensorSpec, read_tensor
from mcore.bridge.sources import check_destination, resolve_source, staged_directory
from mcore.bridge.transforms import to_hf, to_mcore
from mcore.models.config import TransformerConfig
from mcore.train.checkpoint import (
    HF_ASSETS_DIR,
    CheckpointError,
    CheckpointReader,
    ModelCheckpointWriter,
    TensorMeta,
    expected_model_tensors,
)
from mcore.train.output_paths import check_output_dir

log = logging.getLogger("mcore.bridge")

HF_SIDECAR = HF_ASSETS_DIR  # inside an mcore checkpoint: the original config.json and side files, verbatim


@dataclass(frozen=True)
class ConversionResult:
    """What ``convert`` did."""

    direction: str  # "hf->mcore" or "mcore->hf"
    source: Path
    destination: Path
    family: str
    tensors: int
    bytes_written: int
    notes: list[str] = field(default_factory=list)  # entries of the source that were deliberately not carried


def _head_args(config: TransformerConfig) -> dict[str, int]:
    return {
        "num_heads": config.num_attention_heads,
        "num_kv_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
    }


class HFToMcore:
    """A validated HF -> mcore conversion, ready to write."""

    def __init__(self, path: Path, target_dtype: torch.dtype | None):
        self.hf = read_hf_dir(path)
        where = str(path / CONFIG_FILE)
        family = family_for_hf_config(self.hf.config, where)
        config, mtp_note = _without_absent_mtp(hf_to_mcore(self.hf.config, family, where), self.hf.tensors)
        # packed BitNet linears are read unpacked (the latent weights the online quantizer turns back into them)
        self.packed = PackedSources(self.hf.tensors, str(path)) if is_packed_config(self.hf.config) else None
        # DeepSeek's block-wise FP8: checked in full here, dequantized tensor by tensor in write()
        fmt = block_format(self.hf.config, where) if self.packed is None else None
        self.fp8 = Fp8Source(self.hf.tensors, fmt, str(path)) if fmt is not None else None
        tensors = self.hf.tensors if self.packed is None else self.packed.view
        tensors = tensors if self.fp8 is None else self.fp8.tensors
        self.plan: ImportPlan = plan_import(
            family, config, tensors, expected_model_tensors(config), target_dtype, str(path)
        )
        dtypes = sorted({m.dtype for m in self.plan.outputs.values()})
        if len(dtypes) != 1:
            # The mcore checkpoint stores one dtype; keeping several would need a per-tensor dtype there.
            raise BridgeError(f"{path}: tensors have mixed dtypes {dtypes}; pass --dtype to store them as one")
        self.dtype = torch_dtype_from_name(dtypes[0])
        self.notes = [f"not carried: {s}" for s in self.hf.skipped] + mtp_note
        if mxfp4.quantization_method(self.hf.config, where) == mxfp4.METHOD:
            kept = f"{HF_SIDECAR}/{mxfp4.SCALES_FILE}"
            self.notes.append(f"MXFP4 expert weights dequantized to bf16 (their scales kept in {kept})")

    @property
    def total_bytes(self) -> int:
        return sum(_nbytes(m.shape, self.dtype) for m in self.plan.outputs.values())

    def write(self, out: Path, progress: bool | None) -> int:
        plan, config = self.plan, self.plan.config
        heads = _head_args(config)
        with (
            Progress(self.total_bytes, len(plan.steps), "hf -> mcore", progress) as bar,
            ModelCheckpointWriter(out, config, dtype=self.dtype) as writer,
        ):
            for step in plan.steps:
                # cast each input as it is read, so that at most one input exists in both dtypes
                inputs = [self._read(h, plan.sources[h]).to(self.dtype) for h in step.hf]
                meta = plan.outputs[step.mcore]
                padded = meta.shape[meta.vocab_padded_dim] if meta.vocab_padded_dim is not None else None
                tensor = to_mcore(step.op, inputs, padded_rows=padded, **heads)
                del inputs
                writer.add(step.mcore, tensor)
                del tensor
                release_freed_memory()
                bar.advance(_nbytes(plan.outputs[step.mcore].shape, self.dtype))
        sidecar = out / HF_SIDECAR
        sidecar.mkdir()
        shutil.copyfile(self.hf.path / CONFIG_FILE, sidecar / CONFIG_FILE)
        copy_side_files(self.hf.side_files, sidecar)
        if self.fp8 is not None:  # the source's scales, for an FP8 export that gives back the same bytes
            save_scales(self.fp8.scales(), sidecar / SCALES_FILE)
        mxfp4.write_scales(self.hf.tensors, sidecar)  # an MXFP4 source's scales, for a bit-exact MXFP4 export
        return len(plan.steps)

    def _read(self, name: str, entry) -> torch.Tensor:
        if self.packed is not None:
            return self.packed.read(name, entry)
        return read_tensor(entry) if self.fp8 is None else self.fp8.read(name, entry)


def _without_absent_mtp(config: TransformerConfig, tensors) -> tuple[TransformerConfig, list[str]]:
    """transformers' DeepSeek-V3 configs say ``num_nextn_predict_layers: 1`` also for models saved without the MTP
    layer: such a model imports without it (as transformers loads it), with a note."""
    depth, first = config.num_nextn_predict_layers, f"model.layers.{config.num_hidden_layers}."
    if not depth or any(name.startswith(first) for name in tensors):
        return config, []
    note = f"config.json has num_nextn_predict_layers={depth} but no {first}* tensors: imported without MTP modules"
    return dataclasses.replace(config, num_nextn_predict_layers=0), [note]


class McoreToHF:
    """A validated mcore -> HF conversion, ready to write.

    The tensors come from ``read_full(name)`` (full, vocabulary padding removed), so the same code exports a
    checkpoint (:meth:`from_checkpoint`) or a model in memory (``mcore.bridge.api.export_hf``). ``assets`` is a
    directory holding the original ``config.json`` and the side files to copy (the checkpoint's ``hf/``), or None.
    """

    def __init__(
        self,
        config: TransformerConfig,
        saved: dict[str, TensorMeta],
        read_full: Callable[[str], torch.Tensor],
        *,
        where: str,
        target_dtype: torch.dtype | None,
        max_shard_bytes: int,
        assets: Path | None,
        quantize: str | None = None,
        bitnet_packed: bool | None = None,
        fp8_blocks: bool = False,
    ):
        family = family_by_name(config.model_type, where)
        self.plan: ExportPlan = plan_export(family, config, saved, expected_model_tensors(config), target_dtype, where)
        self.encode = _as_is
        if quantize is not None:  # MXFP4 experts (GPT-OSS): keeps an MXFP4 source's scales where they still fit
            if quantize != mxfp4.METHOD:
                raise BridgeError(f"--quantize must be {mxfp4.METHOD!r}, got {quantize!r}")
            outputs = mxfp4.quantized_outputs(self.plan.outputs, where)
            self.plan = dataclasses.replace(self.plan, outputs=outputs)
            self.encode = mxfp4.encoder(assets / mxfp4.SCALES_FILE if assets is not None else None)
        self.read_full = read_full
        self.max_shard_bytes = max_shard_bytes
        self.notes: list[str] = []
        self.original_config_file: Path | None = None
        self.side_files: list[Path] = []
        original = None
        if assets is not None and (assets / CONFIG_FILE).is_file():
            self.original_config_file = assets / CONFIG_FILE
            original = read_config(assets)
            self.side_files = list_side_files(assets, {p.name for p in assets.glob("*.safetensors")})[0]
        else:
            self.notes.append(
                f"{where} carries no Hugging Face files ({HF_SIDECAR}/config.json): config.json is generated from "
                "the model config and no tokenizer files are written (give them with --hf-assets)"
            )
        out_dtypes = sorted({torch_dtype_name(d) for _, d, _ in self.plan.outputs})
        weights_dtype = out_dtypes[0] if len(out_dtypes) == 1 else None
        self.hf_config = mcore_to_hf(config, family, original, weights_dtype=weights_dtype)
        self.hf_config = mxfp4.set_quantization_config(self.hf_config, quantize, original)
        # packed BitNet weights when asked, else as the checkpoint was imported (bitnet_packing.py)
        self.pack = is_packed_config(original) if bitnet_packed is None else bitnet_packed
        if self.pack and family.name != "bitnet":
            raise BridgeError(f"{where}: packed ternary weights are the bitnet family's format, not {family.name}'s")
        self.outputs = packed_outputs(self.plan.outputs) if self.pack else self.plan.outputs
        if self.pack:
            self.hf_config["quantization_config"] = (original or {}).get("quantization_config") or OFFLINE_CONFIG
        elif is_packed_config(self.hf_config):
            del self.hf_config["quantization_config"]  # the weights written are plain
        self._setup_fp8(fp8_blocks, original, assets, where)

    def _setup_fp8(self, fp8_blocks: bool, original, assets: Path | None, where: str) -> None:
        """bf16 drops an FP8 source's quantization_config; ``fp8_blocks`` writes its format (128x128 by default)."""
        self.fp8_format: BlockFormat | None = None
        if not fp8_blocks:
            if (self.hf_config.get("quantization_config") or {}).get("quant_method") == "fp8":
                self.hf_config = without_quantization_config(self.hf_config)
            return
        if self.pack:
            raise BridgeError(f"{where}: --fp8-blocks and packed BitNet weights are two formats; choose one")
        self.fp8_format = (block_format(original, where) if original else None) or BlockFormat(128, 128)
        self.fp8_scales = load_scales(assets)
        self.hf_config.setdefault(
            "quantization_config",
            {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
             "weight_block_size": [self.fp8_format.rows, self.fp8_format.cols]},
        )  # fmt: skip

    def _quantized(self, name: str, shape: tuple[int, ...]) -> bool:
        """The weights an FP8 export quantizes: those the source had quantized, else every linear projection."""
        if self.fp8_format is None:
            return False
        return name + FP8_SCALE_SUFFIX in self.fp8_scales if self.fp8_scales else is_projection(name, shape)

    @classmethod
    def from_checkpoint(
        cls,
        path: Path,
        target_dtype: torch.dtype | None,
        max_shard_bytes: int,
        assets: Path | None = None,
        quantize: str | None = None,
        bitnet_packed: bool | None = None,
        fp8_blocks: bool = False,
    ) -> McoreToHF:
        reader = CheckpointReader(path)
        where = str(reader.path)
        try:
            config = reader.model_config
        except (TypeError, ValueError) as exc:
            raise BridgeError(f"{where}: model_config cannot be read: {exc}") from None
        saved = {name: reader.tensor_meta(name) for name in reader.tensor_names()}

        def read_full(name: str) -> torch.Tensor:
            try:
                return reader.read_full(name)
            finally:
                # safe_open keeps every page it touched mapped (and resident) until closed: release per tensor
                reader.close()

        sidecar = reader.path / HF_SIDECAR
        return cls(
            config,
            saved,
            read_full,
            where=where,
            target_dtype=target_dtype,
            max_shard_bytes=max_shard_bytes,
            assets=assets if assets is not None else (sidecar if sidecar.is_dir() else None),
            quantize=quantize,
            bitnet_packed=bitnet_packed,
            fp8_blocks=fp8_blocks,
        )

    @property
    def total_bytes(self) -> int:
        return sum(_nbytes(shape, dtype) for _, dtype, shape in self.outputs)

    def write(self, out: Path, progress: bool | None) -> int:
        plan, config = self.plan, self.plan.config
        heads = _head_args(config)
        out.mkdir()
        specs = [TensorSpec(name, dtype, shape) for name, dtype, shape in self.outputs]
        if self.fp8_format is not None:
            specs = fp8_specs(specs, self.fp8_format, self._quantized)
        dtype_of = {s.name: s.dtype for s in specs}
        writer = HFWriter(out, specs, self.max_shard_bytes)
        try:
            with Progress(self.total_bytes, len(specs), "mcore -> hf", progress) as bar:
                for step in plan.steps:
                    full = self.read_full(step.mcore)
                    for name, part in zip(step.hf, to_hf(step.op, full, **heads)):
                        # MXFP4 pairs of GPT-OSS's experts (mcore.bridge.mxfp4), then BitNet's packing
                        for hf_name, hf_part in self.encode(name, part):
                            for written, tensor in self._encoded(hf_name, hf_part):
                                writer.write(written, tensor.to(dtype_of[written]))
                                bar.advance(tensor.numel() * dtype_of[written].itemsize)
                    del full, part
                    release_freed_memory()
            writer.finish()
        except BaseException:
            writer.abort()
            raise
        write_config(out, self.hf_config, self.original_config_file)
        copy_side_files(self.side_files, out)
        return len(specs)

    def _encoded(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The HF tensors of ``name``: itself, or its packed ternary weight and ``weight_scale``."""
        if self._quantized(name, tuple(tensor.shape)):  # DeepSeek's block-wise FP8
            q, scale = quantize_blocks(tensor, self.fp8_format, self.fp8_scales.get(name + FP8_SCALE_SUFFIX))
            return [(name, q), (name + FP8_SCALE_SUFFIX, scale)]
        if not (self.pack and is_packed_name(name)):
            return [(name, tensor)]
        packed, scale = quantize_weight(tensor)
        return [(name, packed), (name + SCALE_SUFFIX, scale)]


def _as_is(name: str, tensor: torch.Tensor):
    yield name, tensor


def assets_dir(hf_assets: str | os.PathLike | None) -> Path | None:
    """Check an ``--hf-assets`` directory: it must hold a ``config.json``."""
    if hf_assets is None:
        return None
    assets = Path(hf_assets).expanduser()
    if not (assets / CONFIG_FILE).is_file():
        raise BridgeError(f"--hf-assets {assets}: no config.json there; give a Hugging Face model directory")
    return assets


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    to: str | None = None,
    dtype: str = "keep",
    max_shard_size: str | int = "5GB",
    overwrite: bool = False,
    progress: bool | None = None,
    hf_assets: str | os.PathLike | None = None,
    quantize: str | None = None,
    bitnet_packed: bool | None = None,
    fp8_blocks: bool = False,
) -> ConversionResult:
    """Convert SRC (HF directory, hub id, or mcore checkpoint) into DST, in the direction SRC implies.

    Args:
        to: ``"mcore"`` or ``"hf"``; checked against the direction detected from SRC when given.
        dtype: ``keep`` (bit-exact) or ``bf16``/``fp16``/``fp32`` for floating tensors.
        max_shard_size: largest HF shard (``"5GB"``, ``"500MiB"``, bytes); HF output only.
        overwrite: replace an existing DST (it is only replaced once the new one is complete).
        progress: show the progress bar (``None``: only on a terminal).
        hf_assets: mcore -> HF only: a directory with the ``config.json`` (extra keys, spelling) and tokenizer files
            to write beside the weights, for a checkpoint that carries none (e.g. one saved by training).
        bitnet_packed: mcore -> HF of a bitnet model only: write HF's packed ternary weights (``True``) or plain
            ones (``False``); ``None``: as the HF files the checkpoint was converted from.
        fp8_blocks: mcore -> HF only: write the linear projections in DeepSeek's block-wise FP8 (e4m3 weights and
            fp32 ``weight_scale_inv`` per block); an FP8 source converted to mcore comes back byte for byte.
        quantize: mcore -> HF only: ``"mxfp4"`` writes GPT-OSS's expert weights in MXFP4 (``mcore.bridge.mxfp4``).

    Raises:
        BridgeError: for any problem with the input, before DST is touched.
    """
    if to not in (None, "mcore", "hf"):
        raise BridgeError(f"--to must be 'mcore' or 'hf', got {to!r}")
    target_dtype = parse_dtype_choice(dtype)
    max_shard_bytes = parse_size(max_shard_size)
    dst = Path(dst).expanduser()
    check_output_dir(dst.parent, f"destination {dst}: its directory", BridgeError)  # before reading anything
    if dst.exists() and not overwrite:  # checked before a possibly long hub download
        check_destination(dst, overwrite, [])
    source = resolve_source(src)
    direction = "hf->mcore" if source.kind == "hf" else "mcore->hf"
    detected = "mcore" if source.kind == "hf" else "hf"
    if to is not None and to != detected:
        kind = "a Hugging Face model" if source.kind == "hf" else "an mcore checkpoint"
        raise BridgeError(f"{source.given} is {kind}, which converts --to {detected}, not --to {to}")
    check_destination(dst, overwrite, [source.path])
    try:
        if source.kind == "hf":
            flags = {"--hf-assets": hf_assets, "--bitnet-packed": bitnet_packed, "--quantize": quantize}
            given = [flag for flag, value in flags.items() if value is not None]
            given += ["--fp8-blocks"] if fp8_blocks else []
            if given:
                raise BridgeError(f"{given[0]} applies to mcore -> hf conversions; SRC is a Hugging Face model")
            job: HFToMcore | McoreToHF = HFToMcore(source.path, target_dtype)
        else:
            assets = assets_dir(hf_assets)
            job = McoreToHF.from_checkpoint(
                source.path,
                target_dtype,
                max_shard_bytes,
                assets,
                bitnet_packed=bitnet_packed,
                quantize=quantize,
                fp8_blocks=fp8_blocks,
            )
        with staged_directory(dst, overwrite) as staged:
            count = job.write(staged, progress)
    except CheckpointError as exc:
        raise BridgeError(str(exc)) from None
    for note in job.notes:
        log.warning(note)
    return ConversionResult(direction, source.path, dst, job.plan.family.name, count, job.total_bytes, job.notes)
