"""Mixture-of-experts routing: top-k selection, the load-balancing and z losses, expert counts, bias update.

Router logits and every probability are fp32 whatever the model's dtype (a bf16 softmax over 128 experts
loses the small probabilities that decide the load-balancing loss). Nothing here synchronizes the host:
counts come from ``scatter_add_`` over a fixed number of bins, never ``bincount`` or boolean indexing.

The token movement (permute / unpermute) lives in :mod:`mcore.kernels.moe_permute` and the expert GEMMs in
:mod:`mcore.kernels.grouped_gemm`; both are re-exported here so that ``mcore.kernels.moe`` is the one
module an MoE layer imports.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mcore.kernels.grouped_gemm import grouped_gemm, grouped_gemm_of_activation
from mcore.kernels.moe_permute import PermutePlan, permute, plan_permutation, unpermute

__all__ = [
    "PermutePlan",
    "RouterConfig",
    "Routing",
    "expert_bias_update",
    "grouped_gemm",
    "grouped_gemm_of_activation",
    "load_balancing_loss",
    "load_balancing_loss_from_stats",
    "load_balancing_stats",
    "permute",
    "plan_permutation",
    "route",
    "tokens_per_expert",
    "unpermute",
    "z_loss",
]

_SCORE_FUNCTIONS = ("softmax", "sigmoid")
_GROUP_SCORES = ("top2_sum", "max")


@dataclass(frozen=True)
class RouterConfig:
    """How a router turns ``[tokens, num_experts]`` logits into ``topk`` experts and their weights.

    * ``score_function``: ``"softmax"`` (Mixtral, Qwen, OLMoE) or ``"sigmoid"`` (DeepSeek-V3).
    * ``softmax_before_topk``: softmax over all experts, then top-k (HF's Mixtral / Qwen / OLMoE); when
      false, top-k on the logits and a softmax over the k chosen (Megatron's default; with
      ``norm_topk_prob`` the two are the same function). Sigmoid scores ignore it.
    * ``norm_topk_prob``: divide the k weights by their sum.
    * ``n_group`` / ``topk_group``: group-limited routing (DeepSeek-V3): experts split into ``n_group``
      equal groups, a group scored by the sum of its two best scores, experts chosen among the best
      ``topk_group`` groups only. ``group_score="max"`` scores a group by its best expert instead
      (DeepSeek-V2's ``group_limited_greedy``).
    * ``routed_scaling_factor``: multiplies the final weights (DeepSeek-V3's 2.5).
    """

    num_experts: int
    topk: int
    score_function: str = "softmax"
    softmax_before_topk: bool = True
    norm_topk_prob: bool = False
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    group_score: str = "top2_sum"

    def __post_init__(self) -> None:
        if self.group_score not in _GROUP_SCORES:
            raise ValueError(f"RouterConfig.group_score must be one of {_GROUP_SCORES}, got {self.group_score!r}")
        for name in ("num_experts", "topk", "n_group", "topk_group"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"RouterConfig.{name} must be a positive int, got {value!r}")
        if self.topk > self.num_experts:
            raise ValueError(f"RouterConfig.topk={self.topk} exceeds num_experts={self.num_experts}")
        if self.score_function not in _SCORE_FUNCTIONS:
            raise ValueError(
                f"RouterConfig.score_function must be one of {_SCORE_FUNCTIONS}, got {self.score_function!r}"
            )
        if self.num_experts % self.n_group:
            raise ValueError(
                f"RouterConfig.n_group={self.n_group} must divide num_experts={self.num_experts} "
                "(experts are split into equal groups)"
            )
        if self.topk_group > self.n_group:
            raise ValueError(f"RouterConfig.topk_group={self.topk_group} exceeds n_group={self.n_group}")
        if self.topk > self.topk_group * (self.num_experts // self.n_group):
            raise ValueError(
                f"RouterConfig.topk={self.topk} exceeds the experts of the {self.topk_group} selected groups "
                f"({self.topk_group} x {self.num_experts // self.n_group})"
            )
        if not self.routed_scaling_factor > 0:
            raise ValueError(f"RouterConfig.routed_scaling_factor must be > 0, got {self.routed_scaling_factor}")


@dataclass
class Routing:
    """The router's decision for ``T`` tokens.

    ``weights`` [T, k] fp32 (differentiable), ``indices`` [T, k] int64, ``probs`` [T, E] fp32: the score
    distribution the load-balancing loss uses (softmax over all experts; for sigmoid scores, the scores
    divided by their sum, as DeepSeek-V3's sequence-wise loss does).
    """

    weights: torch.Tensor
    indices: torch.Tensor
    probs: torch.Tensor


def route(logits: torch.Tensor, config: RouterConfig, expert_bias: torch.Tensor | None = None) -> Routing:
    """Top-k routing of ``logits`` [T, E] (any float dtype, computed in fp32) by ``config``.

    ``expert_bias`` [E] (aux-loss-free balancing) is added to the scores when choosing experts only; the
    weights come from the unbiased scores.
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.shape[1] != config.num_experts:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"route: logits must be [tokens, num_experts={config.num_experts}], got {shape}")
    if expert_bias is not None and tuple(expert_bias.shape) != (config.num_experts,):
        raise ValueError(f"route: expert_bias must be [{config.num_experts}], got {tuple(expert_bias.shape)}")
    logits = logits.float()
    if config.score_function == "sigmoid":
        scores = torch.sigmoid(logits)
        probs = scores / scores.sum(-1, keepdim=True)
    else:
        probs = torch.softmax(logits, dim=-1)
        scores = probs if config.softmax_before_topk else logits
    choice = scores.detach() if expert_bias is None else scores.detach() + expert_bias.float()
    indices = _topk_indices(choice, config)
    weights = scores.gather(1, indices)
    if config.score_function == "softmax" and not config.softmax_before_topk:
        weights = torch.softmax(weights, dim=-1)
    elif config.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    if config.routed_scaling_factor != 1.0:
        weights = weights * config.routed_scaling_factor
    return Routing(weights=weights, indices=indices, probs=probs)


def _topk_indices(choice: torch.Tensor, config: RouterConfig) -> torch.Tensor:
    """Indices [T, k] of the chosen experts, restricted to the best ``topk_group`` groups when grouped."""
    if config.n_group > 1:
        tokens = choice.shape[0]
        grouped = choice.view(tokens, config.n_group, -1)
        best = 1 if config.group_score == "max" else min(2, grouped.shape[-1])
        group_scores = grouped.topk(best, dim=-1).values.sum(-1)
        best_groups = group_scores.topk(config.topk_group, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
        choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(tokens, -1)
    return choice.topk(config.topk, dim=-1).indices


def tokens_per_expert(
    indices: torch.Tensor, num_experts: int, padding_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """How many (token, choice) pairs chose each expert: int64 [E], no host sync. ``padding_mask`` [T] bool (True:
    a padding token, e.g. context parallelism's per-document padding): those tokens' choices are not counted."""
    flat = indices.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=indices.device)
    if padding_mask is None:
        return counts.scatter_add_(0, flat, torch.ones_like(flat))
    real = _real_tokens(padding_mask, indices.shape[0]).to(torch.int64)
    return counts.scatter_add_(0, flat, real.unsqueeze(1).expand_as(indices).reshape(-1))


def _real_tokens(padding_mask: torch.Tensor, tokens: int) -> torch.Tensor:
    """``~padding_mask`` [T] bool, after checking it is one flag per token."""
    if not isinstance(padding_mask, torch.Tensor) or padding_mask.dtype != torch.bool:
        kind = padding_mask.dtype if isinstance(padding_mask, torch.Tensor) else type(padding_mask).__name__
        raise TypeError(f"MoE routing: padding_mask must be a bool tensor [tokens={tokens}], got {kind}")
    if tuple(padding_mask.shape) != (tokens,):
        raise ValueError(f"MoE routing: padding_mask must be [tokens={tokens}], got {tuple(padding_mask.shape)}")
    return ~padding_mask


def load_balancing_loss(
    probs: torch.Tensor,
    indices: torch.Tensor,
    *,
    sequence_length: int | None = None,
    padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The Switch Transformer load-balancing loss ``E * sum_e f_e * P_e`` (1.0 when perfectly balanced).

    ``f_e`` is the fraction of the ``T * k`` choices that went to expert e (not differentiable) and ``P_e``
    the mean of ``probs[:, e]`` over the tokens. With ``sequence_length`` the tokens are ``[B * S]`` in
    sequence order and the loss is computed per sequence and averaged (DeepSeek-V3's sequence-wise loss);
    otherwise over the whole micro-batch. Hugging Face's ``load_balancing_loss_func`` returns ``k`` times
    this value (its ``f_e`` sums to k). ``padding_mask`` [T] bool: padding tokens are left out of the counts, the
    probability sums and the token counts (the loss of the real tokens alone).
    """
    counts, prob_sums = load_balancing_stats(probs, indices, sequence_length=sequence_length, padding_mask=padding_mask)
    seq = probs.shape[0] if sequence_length is None else sequence_length
    if padding_mask is not None:
        seq = (~padding_mask).reshape(counts.shape[0], seq).sum(1).float()
    return load_balancing_loss_from_stats(counts, prob_sums, seq, indices.shape[1])


def load_balancing_stats(
    probs: torch.Tensor,
    indices: torch.Tensor,
    *,
    sequence_length: int | None = None,
    padding_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sums behind :func:`load_balancing_loss`, per group of tokens (one group, or one per sequence):
    ``counts`` [G, E] choices per expert (no gradient) and ``prob_sums`` [G, E] (differentiable). Sums add over
    ranks that split the same tokens (sequence parallelism), which makes the loss that of all of them.
    ``padding_mask`` [T] bool: padding tokens add nothing to either sum."""
    tokens, num_experts = probs.shape
    if indices.dim() != 2 or indices.shape[0] != tokens:
        raise ValueError(f"load_balancing_loss: indices must be [{tokens}, k], got {tuple(indices.shape)}")
    k = indices.shape[1]
    seq = tokens if sequence_length is None else sequence_length
    if seq < 1 or tokens % seq:
        raise ValueError(f"load_balancing_loss: sequence_length={sequence_length} must divide the {tokens} tokens")
    batches = tokens // seq
    counts = torch.zeros(batches, num_experts, dtype=torch.float32, device=probs.device)
    probs = probs.float()
    if padding_mask is None:
        ones = torch.ones(batches, seq * k, device=probs.device)
    else:
        real = _real_tokens(padding_mask, tokens).float()
        ones = real.unsqueeze(1).expand(tokens, k).reshape(batches, seq * k)
        probs = probs * real.unsqueeze(1)
    counts.scatter_add_(1, indices.reshape(batches, seq * k), ones)
    return counts, probs.reshape(batches, seq, num_experts).sum(1)


def load_balancing_loss_from_stats(
    counts: torch.Tensor, prob_sums: torch.Tensor, tokens_per_group: int | torch.Tensor, topk: int
) -> torch.Tensor:
    """``E * mean_g sum_e f_ge * P_ge`` with ``f = counts / (tokens * k)`` and ``P = prob_sums / tokens``.

    ``tokens_per_group``: an int, or a tensor [G] of each group's (real) tokens; a group without any counts 0."""
    if isinstance(tokens_per_group, torch.Tensor):
        tokens_per_group = tokens_per_group.to(counts.dtype).clamp(min=1.0).unsqueeze(-1)
    fraction = counts / (tokens_per_group * topk)
    return counts.shape[-1] * (fraction * (prob_sums / tokens_per_group)).sum(-1).mean()


def z_loss(
    logits: torch.Tensor, padding_mask: torch.Tensor | None = None, num_tokens: torch.Tensor | None = None
) -> torch.Tensor:
    """Router z-loss (ST-MoE): the mean over tokens of ``logsumexp(logits)**2``, in fp32.

    ``padding_mask`` [T] bool: the sum runs over the real tokens only and is divided by ``num_tokens`` (default:
    their count here; pass the count over every rank that splits the same tokens to get their joint mean)."""
    squares = torch.logsumexp(logits.float(), dim=-1).square()
    if padding_mask is None:
        return squares.mean()
    real = _real_tokens(padding_mask, logits.shape[0])
    count = real.sum() if num_tokens is None else num_tokens
    return torch.where(real, squares, 0.0).sum() / count.to(squares.dtype).clamp(min=1.0)


@torch.no_grad()
def expert_bias_update(bias: torch.Tensor, counts: torch.Tensor, rate: float) -> torch.Tensor:
    """Aux-loss-free balancing step (DeepSeek-V3), in place: ``b_e += rate * sign(mean(c) - c_e)``.

    ``counts`` [E] are the step's tokens per expert (already summed over every rank that routed tokens);
    under-loaded experts get a larger bias and so more tokens next step. Returns ``bias``.
    """
    if tuple(counts.shape) != tuple(bias.shape) or bias.dim() != 1:
        raise ValueError(f"expert_bias_update: bias {tuple(bias.shape)} and counts {tuple(counts.shape)} must be [E]")
    c = counts.to(torch.float32)
    bias.add_(torch.sign(c.mean() - c).to(bias.dtype), alpha=rate)
    return bias
