"""Layer parts: what a decoder layer is made of, registered by name, one registry per slot.

A decoder layer is ``x + mixer(norm(x))`` then ``x + mlp(norm(x))``. Which mixer and which MLP a layer uses is
chosen per layer index from the config (``layer_types`` and ``mlp_layer_types``, Hugging Face's names). Each part
is a :class:`PartSpec`: how to build its module, what the module is called in the layer (so parameter names stay
those of the checkpoints), its parameter and FLOP counts, and its tensor-parallel contract.
"""

from mcore.models.parts.registry import MIXERS, MLPS, PartContext, PartRegistry, PartSpec

__all__ = ["MIXERS", "MLPS", "PartContext", "PartRegistry", "PartSpec"]
