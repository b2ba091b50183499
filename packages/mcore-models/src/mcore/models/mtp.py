"""Multi-token prediction (DeepSeek-V3's MTP): ``num_nextn_predict_layers`` modules after the last layer, on the last
pipeline stage, that each predict one token further ahead.

Module ``k`` (1-based) at position ``i`` combines the previous depth's hidden state ``h`` (the main model's last
hidden state for ``k = 1``) with the embedding of token ``t[i + k]``: ``eh_proj([enorm(emb(t[i+k])); hnorm(h)])``
(embedding first, as DeepSeek's checkpoints, Megatron and HF lay out ``eh_proj``), runs one decoder layer (the
last layer's parts), and predicts ``t[i + k + 1]`` through its own final norm and the model's shared output layer
(the embedding and output layer are the main model's). Positions whose ``t[i + k]`` lies in another document
(``cu_seqlens``) or past the row do not predict and embed token 0 (Megatron rolls tokens within each packed sequence
the same way and zeroes the positions rolled in).

Under context parallelism (``context_parallel``, an ``mcore.parallel.cp_attention.CPContext``) the rank holds its
shard of every document; ``t[i + k]`` of a shard's last positions lies on other ranks, and the context's
``shift_left`` fetches it (the heads of the later pieces, one all-gather over the CP group). The modules' layers
attend over the CP group as the main model's do. ``mean_k`` is the micro-batch's: each rank sums its positions'
losses and divides by the depth's valid positions counted over the CP group, so the ranks' MTP losses add up to the
micro-batch's, as their shares of the main loss do (the trainer scales both by cp, since DDP averages over dp x cp).

Training loss: ``mtp_loss_weight / D x sum_k mean_k``, ``mean_k`` the mean cross entropy of depth ``k`` over its
valid positions in the micro-batch. It reaches the gradients without changing the returned per-token LM loss: like
the MoE aux losses, it is attached to that loss's graph with a gradient of ``aux_loss_scale`` (which the trainer
sets to the loss scale over the micro-batches, as it does for the MoE layers). ``stats["mtp_loss"]`` keeps the
value. Without labels (inference, generation) the modules are not run.
"""

from __future__ import annotations

import torch
from torch import nn

from mcore.models.config import TransformerConfig
from mcore.models.layers.block import DecoderLayer
from mcore.models.layers.norm import build_norm
from mcore.models.parts.registry import PartContext
from mcore.models.rope import RopeTables
from mcore.parallel.comm import scatter_to_sequence_parallel_region
from mcore.parallel.init import normal_init
from mcore.parallel.tensor_parallel import ColumnParallelLinear

IGNORE_INDEX = -100


class _AttachLoss(torch.autograd.Function):
    """Identity on ``out``; in backward, ``loss`` receives the constant gradient ``scale`` (d total / d loss)."""

    @staticmethod
    def forward(ctx, out, loss, scale):
        ctx.scale, ctx.meta = scale, (loss.shape, loss.dtype, loss.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.meta
        return grad, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


class MTPBlock(nn.Module):
    """One prediction depth: ``enorm``, ``hnorm``, ``eh_proj`` [h, 2h], one decoder ``layer`` and ``final_norm``."""

    def __init__(self, config: TransformerConfig, ctx: PartContext) -> None:
        super().__init__()
        h = config.hidden_size
        norm = dict(sequence_parallel=ctx.sequence_parallel, params_dtype=ctx.params_dtype, device=ctx.device)
        self.enorm = build_norm(config, h, **norm)
        self.hnorm = build_norm(config, h, **norm)
        # Column-parallel with the output gathered: [s, b, h] on every rank, cut back to this rank's tokens under
        # sequence parallelism (its backward gathers them again, so every rank gets the whole output gradient).
        self.eh_proj = ColumnParallelLinear(
            2 * h,
            h,
            gather_output=True,
            tp_group=ctx.tp_group,
            sequence_parallel=ctx.sequence_parallel,
            init_method=normal_init(config.initializer_range),
            params_dtype=ctx.params_dtype,
            device=ctx.device,
        )
        self.tp_group, self.sequence_parallel = ctx.tp_group, ctx.sequence_parallel
        # The transformer layer of this depth has the parts of the model's last layer (MLA + MoE in DeepSeek-V3).
        self.layer = DecoderLayer(config, config.num_hidden_layers - 1, ctx)
        self.final_norm = build_norm(config, h, **norm)

    def forward(
        self, h: torch.Tensor, emb: torch.Tensor, rope: RopeTables, cu_seqlens, context_parallel=None, padding_mask=None
    ):
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(h)], dim=-1))
        if self.sequence_parallel:
            x = scatter_to_sequence_parallel_region(x, self.tp_group)
        return self.layer(x, rope, cu_seqlens, None, context_parallel, padding_mask)


class MultiTokenPrediction(nn.Module):
    """The ``D = num_nextn_predict_layers`` MTP modules of the last stage (``layers.{k-1}``); see the module doc."""

    def __init__(self, config: TransformerConfig, ctx: PartContext) -> None:
        super().__init__()
        self.depth = config.num_nextn_predict_layers
        self.layers = nn.ModuleDict({str(k): MTPBlock(config, ctx) for k in range(self.depth)})
        self.aux_loss_scale = 1.0
        self.stats: dict[str, torch.Tensor] = {}

    def loss(
        self,
        model,
        h,
        input_ids,
        labels,
        rope,
        cu_seqlens,
        loss_weight: float,
        context_parallel=None,
        padding_mask=None,
    ) -> torch.Tensor:
        """``mtp_loss_weight / D x sum_k mean_k`` (fp32 scalar) for the main model's last hidden state ``h``; under
        ``context_parallel``, this rank's share of it (see the module doc).

        ``model`` is the ``GPTModel`` whose embedding, output layer and cross entropy the modules share.
        """
        b, s = input_ids.shape
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for k in range(1, self.depth + 1):
            tokens, targets = _shifted(input_ids, labels, k, cu_seqlens, context_parallel)
            emb = model.embed_tokens(tokens)
            h = self.layers[str(k - 1)](h, emb, rope, cu_seqlens, context_parallel, padding_mask)
            per_token = model.token_losses(self.layers[str(k - 1)].final_norm(h), targets, b, s)
            count = (targets != IGNORE_INDEX).sum()
            if context_parallel is not None:  # the micro-batch's valid positions, not the shard's
                count = context_parallel.sum(count)
            total = total + per_token.sum() / count.clamp(min=1)
        total = total * (loss_weight / self.depth)
        self.stats = {"mtp_loss": total.detach() if context_parallel is None else context_parallel.sum(total)}
        return total

    def attach(self, out: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        """``out`` unchanged, with ``loss`` joining its backward at gradient ``aux_loss_scale``."""
        return _AttachLoss.apply(out, loss, float(self.aux_loss_scale))


def _shifted(input_ids, labels, k: int, cu_seqlens, context_parallel) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens ``t[i + k]`` (0 where ``i + k`` leaves the document) and their targets (``-100`` there)."""
    if context_parallel is not None:
        return context_parallel.shift_left(input_ids, k, 0), context_parallel.shift_left(labels, k, IGNORE_INDEX)
    b, s = input_ids.shape
    doc = _document_ids(cu_seqlens, b, s, input_ids.device)
    valid = (torch.arange(s, device=input_ids.device) < s - k) & (doc == doc.roll(-k, dims=1))
    return input_ids.roll(-k, dims=1).masked_fill(~valid, 0), labels.roll(-k, dims=1).masked_fill(~valid, IGNORE_INDEX)


def _document_ids(cu_seqlens: torch.Tensor | None, b: int, s: int, device: torch.device) -> torch.Tensor:
    """``[b, s]`` index of each token's document (its row when the batch is not packed)."""
    if cu_seqlens is None:
        return torch.arange(b, device=device).unsqueeze(1).expand(b, s)
    tokens = torch.arange(b * s, device=device, dtype=torch.int64)
    return (torch.searchsorted(cu_seqlens.to(device=device, dtype=torch.int64), tokens, right=True) - 1).view(b, s)
