"""Pipeline stages of a model: which layers each virtual stage holds, and this rank's model chunks.

A trainer asks for its chunks and gets :class:`GPTModel` instances holding contiguous layer ranges (the
embedding on the first virtual stage, final norm and output layer on the last), each initialised from the seed
and its global parameter names, so that the weights do not depend on the layout.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mcore.models.accounting import layer_costs, output_layer_flops_per_token
from mcore.models.config import TransformerConfig
from mcore.models.gpt import GPTModel
from mcore.parallel.grid import ProcessGroups
from mcore.parallel.pipeline.layout import balanced_layout, stage_layer_ranges

LAYOUT_RULES = ("even", "balanced")


def pipeline_layout(
    config: TransformerConfig, pp: int, vpp: int, layout: str | Sequence[int], seq_len: int
) -> list[int] | None:
    """Layers per virtual stage for ``layout``: ``"even"`` (``None``: the even split), ``"balanced"`` (from each
    layer's FLOPs and the output layer's; the embedding lookup costs next to nothing) or an explicit list."""
    if isinstance(layout, str) and layout not in LAYOUT_RULES:
        raise ValueError(f"pipeline layout must be one of {LAYOUT_RULES} or a list of layers per stage, got {layout!r}")
    if layout == "even" or pp == 1:
        return None
    if layout == "balanced":
        costs = layer_costs(config, seq_len)
        # In units of the first layer: for equal layers the output layer's cost "in transformer layers".
        unit = costs[0]
        return balanced_layout(
            config.num_hidden_layers,
            pp,
            vpp,
            last_stage_extra=output_layer_flops_per_token(config) / unit,
            layer_costs=[c / unit for c in costs],
        )
    return list(layout)


def build_stage_chunks(
    config: TransformerConfig,
    groups: ProcessGroups,
    *,
    vpp: int = 1,
    layout: Sequence[int] | None = None,
    seed: int,
    sequence_parallel: bool = False,
    recompute: str | None = None,
    recompute_modules: Sequence[str] | None = None,
    params_dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> list[GPTModel]:
    """This pipeline rank's ``vpp`` model chunks (virtual stage ``c * pp + pp_rank`` is chunk ``c``), initialised
    from ``seed``. ``layout``: layers per virtual stage (see :func:`pipeline_layout`; ``None``: the even split)."""
    pp, rank = groups.pp_size, groups.pp_rank
    stages = pp * vpp
    ranges = stage_layer_ranges(config.num_hidden_layers, pp, vpp, layout)[rank]
    chunks = []
    for c, layer_range in enumerate(ranges):
        stage = c * pp + rank
        chunk = GPTModel(
            config,
            groups=groups,
            layer_range=layer_range,
            pre_process=stage == 0,
            post_process=stage == stages - 1,
            sequence_parallel=sequence_parallel,
            recompute=recompute,
            recompute_modules=recompute_modules,
            params_dtype=params_dtype,
            device=device,
        )
        chunk.init_weights(seed)
        chunks.append(chunk)
    return chunks
