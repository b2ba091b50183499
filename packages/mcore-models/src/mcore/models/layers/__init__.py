"""Building blocks of the decoder: attention, gated MLP, norms, embedding / output layer, one layer."""

from mcore.models.layers.attention import SelfAttention
from mcore.models.layers.block import TransformerLayer
from mcore.models.layers.embedding import PaddedVocabInit, build_embedding, build_output_layer, mask_padded_logits
from mcore.models.layers.kv_cache import KVCache
from mcore.models.layers.mlp import GatedMLP
from mcore.models.layers.norm import LayerNorm, RMSNorm, build_norm

__all__ = [
    "GatedMLP",
    "KVCache",
    "LayerNorm",
    "PaddedVocabInit",
    "RMSNorm",
    "SelfAttention",
    "TransformerLayer",
    "build_embedding",
    "build_norm",
    "build_output_layer",
    "mask_padded_logits",
]
