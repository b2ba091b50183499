"""Building blocks of the decoder: the attention and dense MLP parts, norms, embedding / output layer, one layer."""

from mcore.models.layers.attention import SelfAttention
from mcore.models.layers.block import DecoderLayer
from mcore.models.layers.embedding import PaddedVocabInit, build_embedding, build_output_layer, mask_padded_logits
from mcore.models.layers.kv_cache import KVCache
from mcore.models.layers.mlp import GatedMLP
from mcore.models.layers.norm import LayerNorm, RMSNorm, build_norm

__all__ = [
    "DecoderLayer",
    "GatedMLP",
    "KVCache",
    "LayerNorm",
    "PaddedVocabInit",
    "RMSNorm",
    "SelfAttention",
    "build_embedding",
    "build_norm",
    "build_output_layer",
    "mask_padded_logits",
]
