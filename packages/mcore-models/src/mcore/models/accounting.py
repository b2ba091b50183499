"""Parameter counts and model FLOPs (for MFU), summed over the parts each layer is built from.

MFU uses *model* FLOPs (what the math needs, independent of recomputation or padding):

    flops per token = 6 * (matmul weights each token multiplies, output layer included, embedding excluded)
                      + the parts' sequence terms (attention: 12 * num_heads * head_dim * seq_len per layer)

The first term is the forward (2 FLOPs per weight) plus backward (4) of every weight matmul; for a mixture of
experts only the active experts count. The second is what grows with the sequence: attention's score (QK^T) and
weighted-sum (PV) matmuls, forward and backward, over the whole sequence (causal masking and sliding windows are
not discounted, as in the PaLM / Megatron convention). Each part (``mcore.models.parts``) states both terms for
itself, so a new layer type brings its own count. The vocabulary is the real one (not padded). Biases and norms
are not matmuls and are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

from mcore.models.config import TransformerConfig
from mcore.models.parts.registry import MIXERS, MLPS, NO_PART, PartSpec

# Dense bf16 peak FLOP/s of common accelerators (the denominator of MFU), matched as substrings of the device
# name in this order (so "GH200" is not taken for "H200"); the one table of them (mcore-train reads it).
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("GH200", 989.4e12),
    ("H200", 989.4e12),
    ("H100", 989.4e12),
    ("H800", 989.4e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("A10G", 125e12),
    ("L4", 121e12),
)
H100_BF16_PEAK_FLOPS = 989.4e12  # SXM, as in the table
H200_BF16_PEAK_FLOPS = 989.4e12


def peak_bf16_flops(device_name: str) -> float | None:
    """Dense bf16 peak FLOP/s of the accelerator called ``device_name`` (``torch.cuda.get_device_name``), or
    ``None`` when it is not in :data:`PEAK_BF16_FLOPS`."""
    for key, value in PEAK_BF16_FLOPS:
        if key in device_name:
            return value
    return None


@dataclass(frozen=True)
class ParameterCounts:
    """Parameters per component of the whole (unsharded) model, real vocabulary (no padding rows).

    ``mixers`` and ``mlps`` cover all layers' token mixers (attention: projections, biases, q/k norms) and MLPs;
    ``norms`` the pre-norm of every present sub-block and the final norm; ``output`` is 0 when the embedding is
    tied; ``mtp`` the multi-token-prediction modules (DeepSeek-V3), 0 without them.
    """

    embedding: int
    mixers: int
    mlps: int
    norms: int
    output: int
    mtp: int = 0

    @property
    def total(self) -> int:
        return self.embedding + self.mixers + self.mlps + self.norms + self.output + self.mtp

    @property
    def non_embedding(self) -> int:
        """Everything except the embedding table (the output layer counts when it is untied)."""
        return self.total - self.embedding


def layer_parts(config: TransformerConfig, layer_index: int) -> tuple[PartSpec, PartSpec]:
    """The (mixer, MLP) specs layer ``layer_index`` is built from."""
    return MIXERS.get(config.mixer_type(layer_index)), MLPS.get(config.mlp_type(layer_index))


def _norm_params(config: TransformerConfig, width: int) -> int:
    return width * (2 if config.normalization == "layernorm" else 1)


def parameter_counts(config: TransformerConfig) -> ParameterCounts:
    """Parameter count of each component of the model described by ``config``."""
    h, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    mixers = mlps = 0
    norms = 1  # the final norm
    for i in range(layers):
        mixer, mlp = layer_parts(config, i)
        mixers += mixer.parameters(config, i)
        mlps += mlp.parameters(config, i)
        norms += (mixer.name != NO_PART) + (mlp.name != NO_PART)
    return ParameterCounts(
        embedding=vocab * h,
        mixers=mixers,
        mlps=mlps,
        norms=norms * _norm_params(config, h),
        output=0 if config.tie_word_embeddings else vocab * h,
        mtp=mtp_parameters(config),
    )


def mtp_parameters(config: TransformerConfig) -> int:
    """Parameters of the MTP modules: per depth three norms, ``eh_proj`` and one layer of the last layer's parts."""
    if not config.num_nextn_predict_layers:
        return 0
    last = config.num_hidden_layers - 1
    mixer, mlp = layer_parts(config, last)
    norm = _norm_params(config, config.hidden_size)
    layer = mixer.parameters(config, last) + mlp.parameters(config, last) + 2 * norm
    return config.num_nextn_predict_layers * (layer + 3 * norm + 2 * config.hidden_size**2)


def _matmul_weights_of_layer(config: TransformerConfig, layer_index: int) -> int:
    mixer, mlp = layer_parts(config, layer_index)
    return mixer.matmul_weights(config, layer_index) + mlp.matmul_weights(config, layer_index)


def matmul_weight_count(config: TransformerConfig) -> int:
    """Elements of every weight used in a matmul per token: all layers' parts plus the output layer.

    A tied output layer still multiplies every token by the embedding table, so it counts here even though
    it adds no parameters; the embedding lookup (a gather) does not.
    """
    layers = sum(_matmul_weights_of_layer(config, i) for i in range(config.num_hidden_layers))
    return (
        layers + config.vocab_size * config.hidden_size + config.num_nextn_predict_layers * _mtp_depth_weights(config)
    )


def _mtp_depth_weights(config: TransformerConfig) -> int:
    """Matmul weights of one MTP depth: ``eh_proj`` [h, 2h], a layer of the last layer's parts, the output layer."""
    h = config.hidden_size
    return 2 * h * h + _matmul_weights_of_layer(config, config.num_hidden_layers - 1) + config.vocab_size * h


def _check_seq_len(seq_len: int) -> None:
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")


def layer_flops_per_token(config: TransformerConfig, seq_len: int, layer_index: int = 0) -> float:
    """Training model FLOPs per token of layer ``layer_index`` (its matmuls and its parts' sequence terms)."""
    _check_seq_len(seq_len)
    mixer, mlp = layer_parts(config, layer_index)
    sequence = mixer.sequence_flops(config, layer_index, seq_len) + mlp.sequence_flops(config, layer_index, seq_len)
    return float(6 * _matmul_weights_of_layer(config, layer_index) + sequence)


def layer_costs(config: TransformerConfig, seq_len: int) -> list[float]:
    """Training FLOPs per token of every layer, in order (what balanced pipeline layouts weigh)."""
    return [layer_flops_per_token(config, seq_len, i) for i in range(config.num_hidden_layers)]


def output_layer_flops_per_token(config: TransformerConfig) -> float:
    """Training model FLOPs per token of the output layer (tied or not: it always multiplies)."""
    return float(6 * config.vocab_size * config.hidden_size)


def model_flops_per_token(config: TransformerConfig, seq_len: int) -> float:
    """Training (forward + backward) model FLOPs per token at sequence length ``seq_len``: every layer plus the
    output layer (for Llama-shaped models = 6 x ``matmul_weight_count`` + 12 x layers x q_size x seq_len), and the
    MTP depths (each: its ``eh_proj``, one layer like the last, the output layer)."""
    flops = sum(layer_costs(config, seq_len)) + output_layer_flops_per_token(config)
    depth = config.num_nextn_predict_layers
    if depth:
        last = config.num_hidden_layers - 1
        h = config.hidden_size
        flops += depth * (
            6 * 2 * h * h + layer_flops_per_token(config, seq_len, last) + output_layer_flops_per_token(config)
        )
    return flops


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
