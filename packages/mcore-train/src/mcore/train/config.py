"""The ``mcore-train`` configuration: nested typed dataclasses, from YAML plus ``a.b=c`` overrides.

The defaults *are* the embedded demo: a ~1M-parameter Llama-style GPT on the corpus and byte-level
tokenizer shipped in the package, trained for a few hundred steps on CPU or one GPU.

::

    config = load_config("examples/gpt-125m.yaml", ["train.steps=100", "model=llama3-8b"])
    print(dump_config(config))

Sections: ``model`` (an ``mcore.models.TransformerConfig``, optionally named by preset: ``model=llama3-8b``
or ``model.preset: llama3-8b`` plus field overrides), ``parallel``, ``data``, ``optim``, ``lr``, ``train``,
``checkpoint``, ``log``. Unknown keys fail with the nearest valid key; wrong types name the key, the
expected type and the value.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from mcore.models.config import TransformerConfig
from mcore.models.families import PRESETS, get_config
from mcore.models.recompute import check_recompute_modules
from mcore.train.config_checks import non_negative as _non_negative
from mcore.train.config_checks import positive as _positive
from mcore.train.errors import UserError
from mcore.train.low_precision import BitNetSection, Fp4Section, Fp8Section, KernelsSection, check_fp8_param_gather
from mcore.train.lr import LRSchedule
from mcore.train.output_config import CheckpointSection, LogSection
from mcore.train.parallel_config import ParallelSection, check_context_parallel
from mcore.train.typed_config import RawText, from_dict, set_dotted, to_dict

# The embedded demo model: the byte-level vocabulary (256 bytes + 3 special tokens), ~1M parameters.
DEMO_MODEL: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 259,
    "max_position_embeddings": 256,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "make_vocab_size_divisible_by": 64,
}


@dataclass
class DataSection:
    """Where the tokens come from.

    ``path`` is a Megatron ``.bin/.idx`` prefix, or a blend (``"0.3 PREFIX_A 0.7 PREFIX_B"`` or a list of
    prefixes, or of alternating weights and prefixes); ``None`` uses the corpus embedded in the package.
    ``mock: true`` draws random tokens instead (benchmarks). ``tokenizer`` is ``byte`` (the embedded
    byte-level tokenizer) or a Hugging Face tokenizer name or directory. ``split`` gives train/valid/test
    fractions of the documents.
    """

    path: str | list[str | float] | None = None
    mock: bool = False
    tokenizer: str = "byte"
    seq_length: int = 128
    split: str = "95,5,0"
    packing: bool = False
    eod_mask_loss: bool = False
    num_workers: int = 0

    def __post_init__(self) -> None:
        _positive("data", "seq_length", self.seq_length)
        _non_negative("data", "num_workers", self.num_workers)
        if isinstance(self.path, list) and not self.path:
            raise ValueError("data.path is an empty list; give a prefix, a [weight, prefix, ...] list, or null")


# bf16 keeps 8 significant bits: 1 - beta2 must exceed half an ulp (2**-9 to 2**-8 of the value, by where it lies
# in its binade) for v * beta2 to round below v for every v; 2**-8 = 0.0039 gives beta2 < 0.996.
BF16_BETA2_LIMIT = 1 - 2**-8


@dataclass
class OptimSection:
    """AdamW with decoupled weight decay (not applied to norms and biases) and gradient clipping.

    ``offload_fraction``: the share (0 to 1) of the fp32 master weights and AdamW moments kept in host memory and
    updated by the CPU (see ``mcore.parallel.offload``); the rest stays on the device.
    ``main_grads_dtype``: the dtype gradients accumulate, are reduced over dp and clipped in (DDP's buffers; under
    dp_shard, FSDP2's reduce_dtype), fp32 or bf16 (Megatron's ``--main-grads-dtype``).
    ``exp_avg_dtype``: the storage dtype of AdamW's first moment, fp32 or bf16 (Megatron's ``--exp-avg-dtype``).
    ``exp_avg_sq_dtype``: the storage dtype of AdamW's second moment, fp32 or bf16 (``--exp-avg-sq-dtype``).
    The update itself always runs in fp32 on fp32 master weights. bf16 moments keep 8 significant bits: with
    ``beta2`` >= 0.996 some values of a bf16 ``exp_avg_sq`` can no longer decay (``beta2 * v`` rounds back to ``v``;
    from 0.998 none can), so such a ``beta2`` with a bf16 second moment is refused; fp16 is not offered
    (``exp_avg_sq`` underflows it).
    """

    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    clip_grad: float = 1.0
    offload_fraction: float = 0.0
    main_grads_dtype: Literal["fp32", "bf16"] = "fp32"
    exp_avg_dtype: Literal["fp32", "bf16"] = "fp32"
    exp_avg_sq_dtype: Literal["fp32", "bf16"] = "fp32"

    def __post_init__(self) -> None:
        for name in ("main_grads_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
            if getattr(self, name) not in ("fp32", "bf16"):
                raise ValueError(
                    f"optim.{name} must be 'fp32' or 'bf16', got {getattr(self, name)!r} (fp16 is not offered: "
                    "squared gradients underflow it)"
                )
        if self.exp_avg_sq_dtype == "bf16" and self.beta2 >= BF16_BETA2_LIMIT:
            raise ValueError(
                f"optim.beta2={self.beta2} with optim.exp_avg_sq_dtype=bf16: bf16 rounds beta2 * v back to v for "
                f"beta2 >= {BF16_BETA2_LIMIT}, so the second moment could never decay; use a smaller beta2 or "
                "exp_avg_sq_dtype=fp32"
            )
        if not 0.0 <= self.offload_fraction <= 1.0:
            raise ValueError(
                f"optim.offload_fraction must lie in [0, 1] (a share of the states), got {self.offload_fraction}"
            )
        _non_negative("optim", "weight_decay", self.weight_decay)
        _non_negative("optim", "clip_grad", self.clip_grad)
        _positive("optim", "eps", self.eps)
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"optim.{name} must lie in [0, 1), got {value}")


@dataclass
class LRSection:
    """Learning-rate schedule (see :class:`mcore.train.lr.LRSchedule`).

    ``decay_steps`` defaults to ``train.steps``; ``wsd_decay_steps`` (the WSD decay phase) to a fifth of the
    steps between the end of warmup and ``decay_steps``.
    """

    schedule: Literal["cosine", "linear", "wsd", "constant"] = "cosine"
    max_lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 20
    decay_steps: int | None = None
    wsd_decay_steps: int | None = None
    wsd_decay_style: Literal["linear", "cosine", "1-sqrt"] = "1-sqrt"

    def __post_init__(self) -> None:
        _positive("lr", "max_lr", self.max_lr)
        _non_negative("lr", "min_lr", self.min_lr)
        _non_negative("lr", "warmup_steps", self.warmup_steps)
        if self.min_lr > self.max_lr:
            raise ValueError(f"lr.min_lr ({self.min_lr}) must not exceed lr.max_lr ({self.max_lr})")


@dataclass
class TrainSection:
    """Steps, batch sizes, precision and the fault-tolerance knobs of the loop.

    ``global_batch_size`` = ``micro_batch_size`` x micro-batches per step x data-parallel size; the number
    of micro-batches is derived. ``precision=auto`` is bf16 (with fp32 master weights) on CUDA and fp32 on
    CPU; ``fp8``, ``fp4`` and ``quant=bitnet``: see ``low_precision.py``. ``stop_at_step`` ends the run early
    (saving a checkpoint) without changing the LR schedule.
    ``skip_nonfinite`` makes the optimizer skip steps whose gradient norm is NaN/Inf, at the cost of one host
    synchronization per step; ``None`` (auto) turns it on on CPU and with fp16, off on CUDA with bf16/fp32,
    where a non-finite loss or gradient norm is then caught at the next log interval and stops the run.
    ``max_nonfinite_steps`` consecutive skipped steps stop the run. ``activation_offload``: the parts of each
    decoder layer (``attention``, ``mlp``, ``input_norm``, ``mlp_norm``, or ``layer`` for all) whose saved
    activations go to host memory in forward and come back before backward needs them.
    """

    steps: int = 300
    global_batch_size: int = 16
    micro_batch_size: int = 8
    seed: int = 1234
    precision: Literal["auto", "fp32", "bf16", "fp16", "fp8", "fp4"] = "auto"
    quant: Literal["none", "bitnet"] = "none"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    eval_interval: int = 100
    eval_steps: int = 8
    stop_at_step: int | None = None
    max_nonfinite_steps: int = 5
    skip_nonfinite: bool | None = None
    initial_loss_scale: float = 65536.0
    hang_timeout: float = 600.0
    recompute: Literal["none", "full", "selective"] = "none"
    recompute_modules: list[str] | None = None  # selective only: Megatron's --recompute-modules names
    activation_offload: list[str] = field(default_factory=list)
    sample_prompt: str = "The "
    sample_tokens: int = 64
    mtp_loss_weight: float = 0.1  # models with num_nextn_predict_layers > 0 (DeepSeek-V3 MTP)

    def __post_init__(self) -> None:
        for name in ("steps", "global_batch_size", "micro_batch_size", "max_nonfinite_steps"):
            _positive("train", name, getattr(self, name))
        for name in ("eval_interval", "eval_steps", "hang_timeout", "sample_tokens", "mtp_loss_weight"):
            _non_negative("train", name, getattr(self, name))
        _positive("train", "initial_loss_scale", self.initial_loss_scale)
        if self.quant != "none" and self.precision in ("fp8", "fp4"):
            raise ValueError(f"train.quant={self.quant} cannot be combined with train.precision={self.precision}")
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(
                f"train.global_batch_size ({self.global_batch_size}) must be a multiple of train.micro_batch_size "
                f"({self.micro_batch_size})"
            )
        if self.activation_offload and self.recompute == "full":
            raise ValueError(
                "train.activation_offload with train.recompute=full: full recompute keeps only each layer's input, "
                "there is nothing left to offload; use recompute=selective or none with it"
            )
        if self.recompute_modules is not None:
            self.recompute_modules = list(
                check_recompute_modules(self.recompute_modules, self.recompute, "train.recompute_modules")
            )
        if self.stop_at_step is not None and not 0 < self.stop_at_step <= self.steps:
            raise ValueError(f"train.stop_at_step must lie in [1, train.steps={self.steps}], got {self.stop_at_step}")


@dataclass
class Config:
    """Everything a run needs; ``load_config`` builds it, ``to_dict``/``dump_config`` write it back."""

    model: TransformerConfig = field(default_factory=lambda: TransformerConfig(**DEMO_MODEL))
    parallel: ParallelSection = field(default_factory=ParallelSection)
    data: DataSection = field(default_factory=DataSection)
    optim: OptimSection = field(default_factory=OptimSection)
    lr: LRSection = field(default_factory=LRSection)
    train: TrainSection = field(default_factory=TrainSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    log: LogSection = field(default_factory=LogSection)
    fp8: Fp8Section = field(default_factory=Fp8Section)
    fp4: Fp4Section = field(default_factory=Fp4Section)
    bitnet: BitNetSection = field(default_factory=BitNetSection)
    kernels: KernelsSection = field(default_factory=KernelsSection)

    def __post_init__(self) -> None:
        try:
            self.model.check_tensor_parallel(self.parallel.tp)
        except ValueError as exc:
            raise ValueError(f"parallel.tp: {exc}") from None
        self._check_expert_layout()
        layers = self.model.num_hidden_layers
        stages = self.parallel.pp * self.parallel.vpp
        layout = self.parallel.pipeline_layout
        if layout == "even" and layers % stages:
            raise ValueError(
                f"model.num_hidden_layers ({layers}) must be divisible by parallel.pp x parallel.vpp "
                f"({self.parallel.pp} x {self.parallel.vpp} = {stages}), or set parallel.pipeline_layout to "
                f"'balanced' or a list of layers per virtual stage"
            )
        if isinstance(layout, list) and sum(layout) != layers:
            raise ValueError(
                f"parallel.pipeline_layout {layout} holds {sum(layout)} layers but model.num_hidden_layers is {layers}"
            )
        if self.parallel.dp_shard and self.optim.offload_fraction > 0:
            raise ValueError(
                "optim.offload_fraction > 0 cannot be combined with parallel.dp_shard=true (the sharded optimizer runs "
                "on the device); offload with parallel.distributed_optimizer=true (ZeRO-1) or plain data parallelism"
            )
        if self.parallel.sequence_parallel and self.data.seq_length % self.parallel.tp:
            raise ValueError(
                f"parallel.sequence_parallel splits the sequence over tp={self.parallel.tp} ranks, so data.seq_length "
                f"({self.data.seq_length}) must be a multiple of {self.parallel.tp}"
            )
        check_context_parallel(self.parallel, self.model, self.data.seq_length)
        check_fp8_param_gather(self)
        if self.data.seq_length > self.model.max_position_embeddings:
            raise ValueError(
                f"data.seq_length ({self.data.seq_length}) exceeds model.max_position_embeddings "
                f"({self.model.max_position_embeddings})"
            )
        if self.lr.warmup_steps > self.decay_steps:
            raise ValueError(
                f"lr.warmup_steps ({self.lr.warmup_steps}) exceeds the decay end ({self.decay_steps}); lower it or "
                f"raise train.steps / lr.decay_steps"
            )
        self.lr_schedule()  # validates the schedule's own constraints now rather than at step 0

    def _check_expert_layout(self) -> None:
        ep, etp = self.parallel.ep, self.parallel.etp
        if self.model.num_experts is None:
            if ep > 1 or etp is not None:
                raise ValueError(f"parallel.ep={ep} / parallel.etp={etp} need an MoE model; model.num_experts is unset")
            return
        from mcore.models.moe_fields import moe_layer_config

        try:
            moe_layer_config(self.model).check_layout(ep, self.parallel.tp if etp is None else etp)
        except ValueError as exc:
            raise ValueError(f"parallel.ep / parallel.etp: {exc}") from None
        folded = ep > 1 or (etp is not None and etp != self.parallel.tp)
        if folded and self.parallel.dp_shard:
            raise ValueError(
                "parallel.dp_shard (FSDP) does not reduce expert parameters over the expert grid yet; with "
                f"parallel.ep={ep} / parallel.etp={etp} use parallel.distributed_optimizer=true instead"
            )
        # checkpoints gather experts over ep (and over etp when it differs from tp): checkpoint/experts.py

    @property
    def decay_steps(self) -> int:
        return self.lr.decay_steps if self.lr.decay_steps is not None else self.train.steps

    def lr_schedule(self) -> LRSchedule:
        """The learning-rate schedule this config describes."""
        wsd = self.lr.wsd_decay_steps
        if wsd is None:
            wsd = max(1, (self.decay_steps - self.lr.warmup_steps) // 5)
        return LRSchedule(
            schedule=self.lr.schedule,
            max_lr=self.lr.max_lr,
            min_lr=self.lr.min_lr,
            warmup_steps=self.lr.warmup_steps,
            decay_steps=self.decay_steps,
            wsd_decay_steps=wsd if self.lr.schedule == "wsd" else 0,
            wsd_decay_style=self.lr.wsd_decay_style,
        )

    def num_microbatches(self, dp: int) -> int:
        """Micro-batches per step and DP rank: global batch / (micro batch x dp), which must divide."""
        per_rank = self.train.micro_batch_size * dp
        if self.train.global_batch_size % per_rank:
            raise UserError(
                f"train.global_batch_size ({self.train.global_batch_size}) must be a multiple of "
                f"train.micro_batch_size x dp ({self.train.micro_batch_size} x {dp} = {per_rank})"
            )
        return self.train.global_batch_size // per_rank


# ---------------------------------------------------------------------------------------------- loading
def _model_fields(raw: Any) -> dict[str, Any]:
    """The model section as TransformerConfig fields: ``preset`` (if any) first, then explicit fields."""
    if raw is None:
        return dict(DEMO_MODEL)
    if isinstance(raw, TransformerConfig):
        return raw.to_dict()
    if isinstance(raw, str):
        raw = {"preset": str(raw)}
    if not isinstance(raw, Mapping):
        raise UserError(f"config key 'model' expects a preset name or a mapping of fields, got {raw!r}")
    fields = dict(raw)
    preset = fields.pop("preset", None)
    if preset is None:
        return fields
    preset = str(preset)
    if preset not in PRESETS:
        import difflib

        close = difflib.get_close_matches(preset, list(PRESETS), n=1, cutoff=0.4)
        hint = f"did you mean '{close[0]}'?" if close else f"known presets: {', '.join(sorted(PRESETS))}"
        raise UserError(f"unknown model preset '{preset}'; {hint}")
    return {**get_config(preset).to_dict(), **fields}


def build_config(tree: Mapping[str, Any]) -> Config:
    """A validated :class:`Config` from a nested mapping (a parsed YAML file with overrides applied)."""
    if not isinstance(tree, Mapping):
        raise UserError(f"a config file must hold a mapping of sections, got {type(tree).__name__}")
    sections = dict(tree)
    sections["model"] = from_dict(TransformerConfig, _model_fields(sections.get("model")), "model")
    return from_dict(Config, sections, "")


def parse_overrides(items: Sequence[str]) -> list[tuple[str, RawText]]:
    """``["a.b=c", ...]`` -> ``[("a.b", "c"), ...]``; items without ``=`` raise :class:`UserError`."""
    out = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"expected an override of the form section.key=value, got {item!r}")
        out.append((key.strip(), RawText(value)))
    return out


def load_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """Parse a YAML config file; a missing or malformed file raises :class:`UserError`."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"config file not found: {p}") from None
    except OSError as exc:
        raise UserError(f"cannot read config file {p}: {exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise UserError(f"config file {p} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"config file {p} must hold a mapping of sections, got {type(data).__name__}")
    return data


def load_config(
    path: str | os.PathLike | None = None,
    overrides: Sequence[str] = (),
    *,
    base: Mapping[str, Any] | None = None,
    default_model: Mapping[str, Any] | None = None,
) -> Config:
    """The config of a run: defaults, then ``base`` or the YAML file, then ``a.b=c`` overrides in order.

    ``model=NAME`` replaces the model section by preset ``NAME``; ``model.x=v`` sets one field. When neither
    the file nor ``base`` has a model section, the model starts from ``default_model`` (e.g. a checkpoint's
    ``model_config``) or else the embedded demo model.
    """
    if base is not None and path is not None:
        raise ValueError("give either a config file or a base mapping, not both")
    tree: dict[str, Any] = load_yaml(path) if path is not None else _copy_tree(base or {})
    tree.setdefault("model", dict(default_model) if default_model is not None else dict(DEMO_MODEL))
    for key, value in parse_overrides(overrides):
        if key == "model":
            tree["model"] = {"preset": str(value)}
        else:
            set_dotted(tree, key, value)
    return build_config(tree)


def _copy_tree(tree: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _copy_tree(v) if isinstance(v, Mapping) else v for k, v in tree.items()}


def config_to_dict(config: Config) -> dict[str, Any]:
    """The resolved config as plain data (what checkpoints store as ``train_config``)."""
    out = to_dict(config)
    out["model"] = config.model.to_dict()
    return out


def dump_config(config: Config) -> str:
    """The resolved config as YAML (printed at the start of a run)."""
    return yaml.safe_dump(config_to_dict(config), sort_keys=False, default_flow_style=False)
