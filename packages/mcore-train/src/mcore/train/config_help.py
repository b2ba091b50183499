"""``mcore-train config``: every config key with its type, default and one line of help.

The help of a key is its entry in :data:`KEY_HELP`, else the first sentence of its section's docstring that
names it (````key````): a new key documented in its section's docstring needs no entry here. A test checks
that every key has help.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from typing import Any

from mcore.train.config import Config

KEY_HELP: dict[str, str] = {
    "model.hidden_size": "width of the residual stream",
    "model.intermediate_size": "width of the MLP's hidden layer",
    "model.num_hidden_layers": "number of decoder layers",
    "model.num_attention_heads": "query heads per layer",
    "model.vocab_size": "tokenizer vocabulary (padded for TP, see make_vocab_size_divisible_by)",
    "model.max_position_embeddings": "longest sequence the rotary embedding is built for",
    "model.rope_theta": "rotary embedding base",
    "model.rope_scaling": "HF rope_scaling mapping (rope_type linear, llama3 or yarn), or null",
    "model.rms_norm_eps": "epsilon of the norms",
    "model.tie_word_embeddings": "share the input embedding with the output layer",
    "model.mlp_bias": "biases on the MLP's projections",
    "model.qk_norm": "RMSNorm on each head's queries and keys (Qwen3)",
    "model.sliding_window": "attention window of sliding-attention layers, or null",
    "model.hidden_act": "gated MLP activation: silu (SwiGLU) or gelu_pytorch_tanh (GeGLU)",
    "model.normalization": "rmsnorm or layernorm",
    "model.initializer_range": "standard deviation of the initial weights",
    "model.model_type": "the family (llama, qwen2, qwen3, mistral): its HF model_type",
    "parallel.tp": "tensor-parallel size",
    "parallel.dp": "data-parallel size (null: the world size over tp x cp x pp)",
    "parallel.schedule": "pipeline schedule (auto: none at pp=1, 1F1B, interleaved 1F1B when vpp > 1)",
    "parallel.pipeline_layout": "layers per virtual stage: even, balanced (by FLOPs) or a list",
    "data.path": "a .bin/.idx prefix, a blend of them with weights, or null (the embedded corpus)",
    "checkpoint.dir": "where checkpoints go (null: <log.run_dir>/checkpoints); a run resumes from its latest",
    "checkpoint.load": "checkpoint to start from when the run has none yet (full: resume; model-only: fine-tune)",
    "parallel.pp": "pipeline-parallel size",
    "parallel.vpp": "virtual pipeline stages (model chunks) per pipeline rank",
    "parallel.sequence_parallel": "split the activations outside attention/MLP over the TP ranks",
    "parallel.distributed_optimizer": "shard the optimizer state over data parallelism (ZeRO-1)",
    "parallel.overlap_grad_reduce": "reduce gradient buckets over dp while the backward runs",
    "parallel.bucket_size": "elements per gradient bucket",
    "data.packing": "pack documents into each sequence with document-aware attention (no cross-document attention)",
    "data.seq_length": "tokens per sample",
    "data.eod_mask_loss": "leave the end-of-document token out of the loss",
    "data.num_workers": "data loader worker processes",
    "optim.weight_decay": "decoupled weight decay of matrices (norms and biases have none)",
    "optim.beta1": "AdamW beta1",
    "optim.beta2": "AdamW beta2",
    "optim.eps": "AdamW epsilon",
    "optim.clip_grad": "clip the global gradient norm to this (0: no clipping)",
    "lr.schedule": "cosine, linear, wsd (warmup-stable-decay) or constant",
    "lr.max_lr": "learning rate after warmup",
    "lr.min_lr": "learning rate at the end of the decay",
    "lr.warmup_steps": "linear warmup steps",
    "lr.wsd_decay_style": "shape of the WSD decay phase",
    "train.steps": "optimizer steps of the run",
    "train.micro_batch_size": "samples per micro-batch and rank",
    "train.seed": "seed of initialisation, data order and dropout streams",
    "train.device": "auto (CUDA when available), cpu or cuda",
    "train.eval_interval": "evaluate every this many steps (0: never)",
    "train.eval_steps": "global batches per evaluation",
    "train.initial_loss_scale": "first loss scale of fp16 training",
    "train.hang_timeout": "seconds without progress before the watchdog reports a hang and exits (0: off)",
    "train.recompute": "activation recomputation: none, full (whole layers) or selective (attention core)",
    "train.recompute_modules": "with recompute=selective, the sub-blocks recomputed (Megatron's names): core_attn, "
    "mla_up_proj, layernorm, mlp (dense), moe, shared_experts, moe_act (always on in our experts); null: each "
    "part's default",
    "train.sample_prompt": "prompt of the sample generated at the end of a run",
    "train.sample_tokens": "tokens of that sample (0: no sample)",
    "train.mtp_loss_weight": "weight of the multi-token-prediction loss (model.num_nextn_predict_layers > 0), "
    "divided over the prediction depths",
    "checkpoint.save_at_end": "save a checkpoint when the run finishes",
    "checkpoint.keep_last": "checkpoints kept in the directory (older ones are deleted)",
    "checkpoint.async_save": "write checkpoints from a background thread",
    "checkpoint.finetune": "load only the weights of a full checkpoint and start at step 0",
    "checkpoint.load_optimizer": "restore the optimizer state when resuming",
    "checkpoint.load_rng": "restore the RNG states when resuming at the same layout",
    "log.interval": "steps per train log line (each one synchronizes with the device)",
    "log.progress_bar": "show a progress bar on the console",
    "log.tensorboard": "also write TensorBoard events",
    "log.plot": "draw the loss curves at the end of the run",
    "log.gpu_stats_interval": "steps between GPU utilisation/temperature/power lines (0: never)",
    "log.straggler_interval": "steps between reports of slow ranks (0: never)",
    "model.qk_norm_scope": "q/k norm over each head (head, Qwen3) or over the whole projection (projection, OLMoE)",
    "model.num_experts": "routed experts per MoE layer (null: a dense model)",
    "model.num_experts_per_tok": "experts each token is routed to (top-k)",
    "model.moe_intermediate_size": "hidden width of each routed expert",
    "model.norm_topk_prob": "renormalise the top-k routing weights to sum to 1",
    "model.shared_expert_intermediate_size": "hidden width of the shared expert (Qwen2-MoE), or null",
    "model.shared_expert_gate": "sigmoid gate on the shared expert's output (Qwen2-MoE)",
    "model.router_aux_loss_coef": "weight of the load-balancing loss in the training loss",
    "model.moe_router": "router training knobs (z-loss, capacity factor, dispatcher, bias update rate...)",
    "model.q_lora_rank": "MLA query down-projection rank (DeepSeek-V3: 1536), or null for a full-rank query",
    "model.kv_lora_rank": "MLA key/value latent width (512); set: every layer's mixer is multi-head latent attention",
    "model.qk_nope_head_dim": "MLA query/key width without RoPE per head (128)",
    "model.qk_rope_head_dim": "MLA decoupled RoPE width per head, its key shared over heads (64)",
    "model.v_head_dim": "MLA value width per head (128)",
    "model.rope_interleave": "rotary dims stored as interleaved pairs (DeepSeek checkpoints), not halves",
    "model.first_k_dense_replace": "MoE models: the first k layers have the dense MLP (DeepSeek)",
    "model.num_nextn_predict_layers": "multi-token-prediction depths after the last layer (DeepSeek-V3: 1)",
    "model.attention_sinks": "a learned logit per head in the softmax denominator (GPT-OSS), trained",
    "model.router_bias": "bias on the MoE router's logits (GPT-OSS)",
    "model.expert_biases": "biases on every expert's two projections (GPT-OSS)",
    "model.swiglu_alpha": "GPT-OSS's clamped SwiGLU: the sigmoid's slope (1.702); null: plain SwiGLU",
    "model.swiglu_limit": "GPT-OSS's clamped SwiGLU: gate and up clamped to this (7.0); null: no clamp",
    "model.mamba_num_heads": "Mamba-2 heads of the mamba2 mixer",
    "model.mamba_head_dim": "width of each Mamba-2 head",
    "model.ssm_state_size": "SSM state size N per head",
    "model.n_groups": "groups sharing B and C (TP splits whole groups)",
    "model.conv_kernel": "width of the causal depthwise convolution over xBC",
    "model.chunk_size": "chunk length of the SSD scan",
    "model.use_conv_bias": "bias on the causal convolution",
    "model.mamba_proj_bias": "biases on the Mamba-2 in/out projections",
    "model.mamba_norm_before_gate": "gated RMSNorm normalises before (true) or after (false) the gate",
    "model.time_step_limit": "clamp of dt after softplus, as [min, max], or null",
    "model.mamba_rms_norm": "gated RMSNorm inside the Mamba-2 mixer",
    "model.projectors_bias": "biases on Falcon-H1's projections",
    "model.embedding_multiplier": "Falcon-H1 muP multiplier of the input embedding",
    "model.lm_head_multiplier": "Falcon-H1 muP multiplier of the output logits",
    "model.key_multiplier": "Falcon-H1 muP multiplier of the attention keys",
    "model.attention_in_multiplier": "Falcon-H1 muP multiplier of the attention input",
    "model.attention_out_multiplier": "Falcon-H1 muP multiplier of the attention output",
    "model.ssm_in_multiplier": "Falcon-H1 muP multiplier of the Mamba input",
    "model.ssm_out_multiplier": "Falcon-H1 muP multiplier of the Mamba output",
    "model.ssm_multipliers": "Falcon-H1 muP multipliers of the Mamba in_proj blocks [z, x, B, C, dt]",
    "model.mlp_multipliers": "Falcon-H1 muP multipliers of the MLP's gate and down projections",
    "parallel.ep": "expert-parallel size (experts split over ep ranks; must divide num_experts)",
    "parallel.etp": "expert tensor-parallel size (null: the same as tp)",
    "parallel.cp": "context-parallel size (each sequence split into 2 x cp chunks over cp ranks)",
    "parallel.cp_comm_type": "how attention spans the CP ranks: p2p (K/V ring), all_gather, a2a (Ulysses), a2a+p2p",
    "parallel.cp_a2a_size": "with cp_comm_type=a2a+p2p: ranks per a2a group (divides cp; a ring across the groups)",
    "parallel.cp_dynamic": "dynamic CP: each document of the global batch gets the CP size its length needs (tp=pp=1)",
    "fp4.keep": "name patterns of linears kept in high precision ({first}/{last}: the first/last layer's)",
    "fp4.min_features": "linears with fewer input or output features stay in high precision",
    "fp4.on_mismatch": "a linear whose shape does not fit the recipe: error, or fallback to high precision",
    "bitnet.keep": "name patterns of linears kept in high precision ({first}/{last}: the first/last layer's)",
    "bitnet.min_features": "linears with fewer input or output features stay in high precision",
    "bitnet.on_mismatch": "a linear whose shape does not fit: error, or fallback to high precision",
}


@dataclasses.dataclass(frozen=True)
class KeyInfo:
    key: str
    type: str
    default: Any
    help: str


def _type_name(tp: Any) -> str:
    text = tp.__name__ if isinstance(tp, type) else str(tp)
    return re.sub(r"\b(typing|builtins)\.", "", text).replace("NoneType", "None")


def _sentences(doc: str) -> list[str]:
    text = " ".join(doc.split())
    return [s.strip() for s in re.split(r"(?<=[.;:])\s+(?=[A-Z`(])", text) if s.strip()]


def _from_docstring(cls: type, name: str) -> str | None:
    for sentence in _sentences(cls.__doc__ or ""):
        if f"``{name}``" in sentence or f"``{name}=" in sentence or f"``{name}:" in sentence:
            return sentence.replace("``", "")
    return None


def config_keys(config: Config | None = None) -> list[KeyInfo]:
    """Every leaf key of the config, in declaration order, with defaults from ``config`` (default: the demo)."""
    config = config or Config()
    out: list[KeyInfo] = []
    for section in dataclasses.fields(Config):
        value = getattr(config, section.name)
        cls = type(value)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            key = f"{section.name}.{f.name}"
            text = KEY_HELP.get(key) or _from_docstring(cls, f.name) or ""
            out.append(KeyInfo(key, _type_name(hints[f.name]), getattr(value, f.name), text))
    return out


def format_config_keys(keys: list[KeyInfo]) -> str:
    """One line per key: ``key  type  default  help``, in aligned columns."""
    rows = [(k.key, k.type, "null" if k.default is None else repr(k.default), k.help) for k in keys]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    header = ("key", "type", "default", "help")
    lines = [header, *rows]
    return "\n".join(
        "  ".join(cell.ljust(widths[i]) if i < 3 else cell for i, cell in enumerate(row)).rstrip() for row in lines
    )
