"""Parameter counts and model FLOPs (for MFU), computed from the config alone.

MFU uses *model* FLOPs (what the math needs, independent of recomputation or padding):

    flops per token = 6 * (matmul weights, output layer included, embedding lookup excluded)
                      + 12 * num_layers * (num_heads * head_dim) * seq_len

The first term is the forward (2 FLOPs per weight) plus backward (4) of every weight matmul; the second the
score (QK^T) and weighted-sum (PV) matmuls of attention, forward and backward, counted over the whole
sequence (causal masking and sliding windows are not discounted, as in the PaLM / Megatron convention).
The vocabulary is the real one (not padded). Biases and norms are not matmuls and are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

from mcore.models.config import TransformerConfig

# Dense bf16 peak of one H100 / H200 SXM (both 989.4 TFLOP/s), the denominator of MFU.
H100_BF16_PEAK_FLOPS = 989.4e12
H200_BF16_PEAK_FLOPS = 989.4e12


@dataclass(frozen=True)
class ParameterCounts:
    """Parameters per component of the whole (unsharded) model, real vocabulary (no padding rows).

    ``attention`` and ``mlp`` cover all layers (projections, their biases and Qwen3's q/k norms);
    ``norms`` the per-layer pre-norms and the final norm; ``output`` is 0 when the embedding is tied.
    """

    embedding: int
    attention: int
    mlp: int
    norms: int
    output: int

    @property
    def total(self) -> int:
        return self.embedding + self.attention + self.mlp + self.norms + self.output

    @property
    def non_embedding(self) -> int:
        """Everything except the embedding table (the output layer counts when it is untied)."""
        return self.total - self.embedding


def _norm_params(config: TransformerConfig, width: int) -> int:
    return width * (2 if config.normalization == "layernorm" else 1)


def attention_params_per_layer(config: TransformerConfig) -> int:
    """Parameters of one attention block (fused QKV, output projection, optional biases and q/k norms)."""
    h, d = config.hidden_size, config.head_dim
    qkv_out = config.q_size + 2 * config.kv_size
    n = h * qkv_out + config.q_size * h
    if config.attention_bias:
        n += qkv_out
    if config.attention_out_bias:
        n += h
    if config.qk_norm:
        n += 2 * _norm_params(config, d)
    return n


def mlp_params_per_layer(config: TransformerConfig) -> int:
    """Parameters of one gated MLP (fused [gate; up] and down projections, optional biases)."""
    h, f = config.hidden_size, config.intermediate_size
    n = 3 * h * f
    if config.mlp_bias:
        n += 2 * f + h
    return n


def parameter_counts(config: TransformerConfig) -> ParameterCounts:
    """Parameter count of each component of the model described by ``config``."""
    h, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    return ParameterCounts(
        embedding=vocab * h,
        attention=layers * attention_params_per_layer(config),
        mlp=layers * mlp_params_per_layer(config),
        norms=(2 * layers + 1) * _norm_params(config, h),
        output=0 if config.tie_word_embeddings else vocab * h,
    )


def _matmul_weights_per_layer(config: TransformerConfig) -> int:
    """Elements of one transformer layer's matmul weights: fused QKV, output projection, gated MLP."""
    h, f = config.hidden_size, config.intermediate_size
    return h * (config.q_size + 2 * config.kv_size) + config.q_size * h + 3 * h * f


def matmul_weight_count(config: TransformerConfig) -> int:
    """Elements of every weight used in a matmul per token: all projections plus the output layer.

    A tied output layer still multiplies every token by the embedding table, so it counts here even though
    it adds no parameters; the embedding lookup (a gather) does not.
    """
    return config.num_hidden_layers * _matmul_weights_per_layer(config) + config.vocab_size * config.hidden_size


def _check_seq_len(seq_len: int) -> None:
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")


def layer_flops_per_token(config: TransformerConfig, seq_len: int) -> float:
    """Training model FLOPs per token of one transformer layer (its matmuls and its attention scores)."""
    _check_seq_len(seq_len)
    return float(6 * _matmul_weights_per_layer(config) + 12 * config.q_size * seq_len)


def output_layer_flops_per_token(config: TransformerConfig) -> float:
    """Training model FLOPs per token of the output layer (tied or not: it always multiplies)."""
    return float(6 * config.vocab_size * config.hidden_size)


def model_flops_per_token(config: TransformerConfig, seq_len: int) -> float:
    """Training (forward + backward) model FLOPs per token at sequence length ``seq_len``: every layer plus the
    output layer (= 6 x ``matmul_weight_count`` + 12 x layers x q_size x seq_len)."""
    _check_seq_len(seq_len)
    return config.num_hidden_layers * layer_flops_per_token(config, seq_len) + output_layer_flops_per_token(config)


def mfu(
    tokens_per_second: float,
    flops_per_token: float,
    num_gpus: int = 1,
    peak_flops_per_gpu: float = H200_BF16_PEAK_FLOPS,
) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the peak of ``num_gpus`` devices (0..1)."""
    if num_gpus < 1:
        raise ValueError(f"num_gpus must be >= 1, got {num_gpus}")
    if peak_flops_per_gpu <= 0:
        raise ValueError(f"peak_flops_per_gpu must be > 0, got {peak_flops_per_gpu}")
    if tokens_per_second < 0 or flops_per_token < 0:
        raise ValueError(
            f"tokens_per_second and flops_per_token must be >= 0, got {tokens_per_second} and {flops_per_token}"
        )
    return tokens_per_second * flops_per_token / (num_gpus * peak_flops_per_gpu)
