"""Conversion plans: which tensors are read, how they are combined, and what is written, decided and checked in
full before any byte is written.

A plan is a list of :class:`Step`, one per mcore parameter, naming its Hugging Face tensors and the operation
between them (``copy``, ``qkv``, ``gate_up``, ``vocab``). Building a plan validates the source completely:
missing tensors, tensors no rule consumes, and shapes that disagree with the config all fail here, naming the
tensors, so that a bad source never leaves a partial destination behind.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mcore.bridge import stacked_experts
from mcore.bridge.dtypes import cast_dtype, torch_dtype_from_name, torch_dtype_name
from mcore.bridge.errors import BridgeError
from mcore.bridge.mappings import FamilyMapping
from mcore.bridge.mappings.base import EXPERT_OPS, Op
from mcore.bridge.safetensors_io import TensorEntry
from mcore.bridge.stacked_experts import STACKED_OPS
from mcore.models.config import TransformerConfig
from mcore.models.layers.block import layer_module_names
from mcore.train.checkpoint.format import TensorMeta

_SHOW = 4  # names listed in an error message before "... and N more"


@dataclass(frozen=True)
class Step:
    """One mcore parameter and the HF tensors it is made of."""

    mcore: str
    hf: tuple[str, ...]
    op: Op
    export_only: bool = False  # an HF copy of a tensor another step imports (MTP's repeated embedding and head)


def steps_for(family: FamilyMapping, config: TransformerConfig) -> list[Step]:
    """Expand the family's tensor rules for ``config`` (layers, optional biases and norms, tied output)."""
    steps = []
    for rule in family.tensors:
        if not rule.applies(config):
            continue
        layers = range(config.num_hidden_layers) if rule.per_layer else [None]
        for layer in layers:
            # A per-layer rule applies to the layers holding its module (hybrids: attention or MoE on some only).
            if layer is not None and rule.mcore.split(".")[2] not in layer_module_names(config, layer):
                continue
            if rule.mlp is not None and config.mlp_type(layer) != rule.mlp:  # MoE or dense MLP layers only
                continue
            fmt = {"layer": layer} if layer is not None else {}
            steps.append(_expand(rule, fmt, fmt, config))
    steps += _mtp_steps(family, config)
    used = [h for step in steps for h in step.hf]
    if len(set(used)) != len(used):
        twice = sorted({h for h in used if used.count(h) > 1})
        raise ValueError(f"family {family.name!r}: HF tensors {twice} feed two parameters of this model")
    return steps


def _expand(rule, fmt_mcore: dict, fmt_hf: dict, config: TransformerConfig, mcore: str | None = None) -> Step:
    if rule.op in EXPERT_OPS:  # each pattern once per expert, pattern by pattern
        hf = tuple(h.format(**fmt_hf, expert=e) for h in rule.hf for e in range(config.num_experts))
    else:
        hf = tuple(h.format(**fmt_hf) for h in rule.hf)
    return Step((mcore or rule.mcore).format(**fmt_mcore), hf, rule.op)


def _mtp_steps(family: FamilyMapping, config: TransformerConfig) -> list[Step]:
    """Steps of the MTP depths: their own tensors, their decoder layer (the last layer's rules), the HF copies."""
    last = config.num_hidden_layers - 1
    modules = layer_module_names(config, last)
    steps = []
    for k in range(config.num_nextn_predict_layers):
        at = {"layer": config.num_hidden_layers + k}
        steps += [_expand(r, {"layer": k}, at, config) for r in family.mtp_tensors if r.applies(config)]
        for rule in family.tensors:
            if not (rule.per_layer and rule.applies(config)) or rule.mcore.split(".")[2] not in modules:
                continue
            if rule.mlp is not None and config.mlp_type(last) != rule.mlp:
                continue
            inner = rule.mcore.removeprefix("layers.{layer}.")
            steps.append(_expand(rule, {}, at, config, mcore=f"mtp.layers.{k}.layer.{inner}"))
        for mcore, hf in family.mtp_copies:
            if mcore == "output.weight" and config.tie_word_embeddings:
                continue
            steps.append(Step(mcore, (hf.format(**at),), "vocab", export_only=True))
    return steps


def hf_shapes(step: Step, mcore_shape: tuple[int, ...], config: TransformerConfig) -> tuple[tuple[int, ...], ...]:
    """Shapes of the HF tensors of ``step``, given the unpadded mcore shape."""
    rest = mcore_shape[1:]
    if step.op == "qkv":
        q = (config.num_attention_heads * config.head_dim, *rest)
        kv = (config.num_key_value_heads * config.head_dim, *rest)
        return (q, kv, kv)
    if step.op == "gate_up":
        return ((mcore_shape[0] // 2, *rest),) * 2
    if step.op in STACKED_OPS:  # one stacked HF tensor, transposed and/or interleaved
        return (stacked_experts.hf_shape(step.op, mcore_shape),)
    if step.op == "experts":  # [E, out, in] from E tensors [out, in]
        return (tuple(mcore_shape[1:]),) * mcore_shape[0]
    if step.op == "experts_gate_up":  # [E, 2F, H] from E gate [F, H] then E up [F, H]
        return ((mcore_shape[1] // 2, *mcore_shape[2:]),) * (2 * mcore_shape[0])
    return (mcore_shape,)


def unpadded_shape(meta: TensorMeta) -> tuple[int, ...]:
    shape = list(meta.shape)
    if meta.vocab_padded_dim is not None:
        shape[meta.vocab_padded_dim] = meta.vocab_size
    return tuple(shape)


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOW])
    return shown + (f" ... and {len(names) - _SHOW} more" if len(names) > _SHOW else "")


def check_steps_match_model(steps: list[Step], expected: dict[str, TensorMeta], family: FamilyMapping) -> None:
    """The mapping must produce exactly the model's parameters; a difference is a bug in a mapping file."""
    produced = {s.mcore for s in steps}
    missing, extra = sorted(set(expected) - produced), sorted(produced - set(expected))
    if missing or extra:
        raise RuntimeError(
            f"the {family.name} mapping does not match mcore.models' parameters: the model has "
            f"{missing or 'nothing'} that no rule makes, rules make {extra or 'nothing'} the model lacks"
        )


@dataclass(frozen=True)
class ImportPlan:
    """HF -> mcore: for each step, the HF entries to read and the mcore tensor's metadata as written."""

    family: FamilyMapping
    config: TransformerConfig
    steps: list[Step]
    sources: dict[str, TensorEntry]
    outputs: dict[str, TensorMeta]  # mcore name -> metadata (dtype as written), in step order


def plan_import(
    family: FamilyMapping,
    config: TransformerConfig,
    tensors: dict[str, TensorEntry],
    expected: dict[str, TensorMeta],
    target_dtype: torch.dtype | None,
    where: str,
) -> ImportPlan:
    """Check HF ``tensors`` against the mapping and ``config``; raise BridgeError naming every problem kind."""
    steps = steps_for(family, config)
    check_steps_match_model(steps, expected, family)
    needed = {h: s for s in steps for h in s.hf}
    missing = [h for h in needed if h not in tensors]
    if missing:
        raise BridgeError(f"{where}: missing tensor(s) the {family.name} mapping needs: {_listing(missing)}")
    extra = [name for name in tensors if name not in needed]
    if extra:
        hint = ""
        if "lm_head.weight" in extra and config.tie_word_embeddings:
            hint = " (lm_head.weight is stored although config.json says tie_word_embeddings=true)"
        elif any(name.endswith("rotary_emb.inv_freq") for name in extra):
            hint = " (rotary inv_freq buffers are recomputed from config.json; re-save without them)"
        raise BridgeError(f"{where}: tensor(s) no {family.name} mapping consumes: {_listing(extra)}{hint}")
    outputs: dict[str, TensorMeta] = {}
    for step in steps:
        meta = expected[step.mcore]
        want = hf_shapes(step, unpadded_shape(meta), config)
        entries = [tensors[h] for h in step.hf]
        for entry, shape in zip(entries, want):
            if entry.shape != shape:
                raise BridgeError(
                    f"{where}: tensor {entry.name} has shape {list(entry.shape)} but config.json implies "
                    f"{list(shape)} (hidden_size={config.hidden_size}, heads={config.num_attention_heads}, "
                    f"kv_heads={config.num_key_value_heads}, head_dim={config.head_dim}, "
                    f"intermediate_size={config.intermediate_size}, vocab_size={config.vocab_size})"
                )
        dtypes = {e.dtype for e in entries}
        if len(dtypes) > 1:
            raise BridgeError(
                f"{where}: {', '.join(step.hf)} are fused into {step.mcore} but have different dtypes "
                f"{sorted(str(d) for d in dtypes)}; convert with --dtype to a single dtype"
            )
        if step.export_only:  # checked, then dropped: the main model's tensor is imported once
            continue
        dtype = cast_dtype(entries[0].dtype, target_dtype)
        outputs[step.mcore] = TensorMeta(
            shape=meta.shape,
            dtype=torch_dtype_name(dtype),
            partition_dim=meta.partition_dim,
            partition_blocks=meta.partition_blocks,
            vocab_padded_dim=meta.vocab_padded_dim,
            vocab_size=meta.vocab_size,
        )
    sources = {h: tensors[h] for s in steps for h in s.hf}
    return ImportPlan(family, config, [s for s in steps if not s.export_only], sources, outputs)


@dataclass(frozen=True)
class ExportPlan:
    """mcore -> HF: for each step, the HF tensors written (name, dtype, shape) in writing order."""

    family: FamilyMapping
    config: TransformerConfig
    steps: list[Step]
    outputs: list[tuple[str, torch.dtype, tuple[int, ...]]]


def plan_export(
    family: FamilyMapping,
    config: TransformerConfig,
    saved: dict[str, TensorMeta],
    expected: dict[str, TensorMeta],
    target_dtype: torch.dtype | None,
    where: str,
) -> ExportPlan:
    """Check an mcore checkpoint's tensors against the mapping; raise BridgeError for missing, extra or
    mis-shaped tensors."""
    steps = steps_for(family, config)
    check_steps_match_model(steps, expected, family)
    missing = [s.mcore for s in steps if s.mcore not in saved]
    if missing:
        raise BridgeError(f"{where}: missing tensor(s) of the {family.name} model: {_listing(missing)}")
    produced = {s.mcore for s in steps}
    extra = [name for name in saved if name not in produced]
    if extra:
        raise BridgeError(f"{where}: tensor(s) no {family.name} mapping consumes: {_listing(extra)}")
    outputs = []
    for step in steps:
        have, want = unpadded_shape(saved[step.mcore]), unpadded_shape(expected[step.mcore])
        if have != want:
            raise BridgeError(
                f"{where}: tensor {step.mcore} has shape {list(have)} (without vocabulary padding) but the "
                f"model_config implies {list(want)}"
            )
        dtype = cast_dtype(torch_dtype_from_name(saved[step.mcore].dtype), target_dtype)
        for name, shape in zip(step.hf, hf_shapes(step, want, config)):
            outputs.append((name, dtype, shape))
    return ExportPlan(family, config, steps, outputs)
