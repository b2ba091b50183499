"""``train.activation_offload``: what chosen parts of every decoder layer save for backward goes to host memory.

The names are those of a decoder layer's modules (``input_norm``, ``attention``, ``mlp_norm``, ``mlp``, or the
name of another registered part), or ``layer`` for the whole layer; see ``mcore.parallel.activation_offload``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from mcore.parallel.activation_offload import ActivationOffload
from mcore.train.errors import UserError

__all__ = ["attach_activation_offload"]

WHOLE_LAYER = "layer"


def attach_activation_offload(
    chunks: Sequence[nn.Module], names: Sequence[str], device: torch.device
) -> ActivationOffload:
    """Hook the named parts of every decoder layer of ``chunks`` (in forward order) into one ``ActivationOffload``."""
    groups: list[list[nn.Module]] = []
    for chunk in chunks:
        for index, layer in chunk.layers.items():
            children = dict(layer.named_children())
            modules = []
            for name in names:
                if name == WHOLE_LAYER:
                    modules.append(layer)
                elif name in children:
                    modules.append(children[name])
                else:
                    raise UserError(
                        f"train.activation_offload: layer {index} has no part {name!r}; choose from "
                        f"{[WHOLE_LAYER, *children]}"
                    )
            groups.append(modules)
    offload = ActivationOffload(device)
    offload.attach(groups)
    return offload
