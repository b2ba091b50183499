"""The small transformer-like stack the pipeline tests train, its float64 reference, and single-process checks.

The stack: a vocab-parallel embedding on the first stage, ``layers`` residual blocks
``x + fc2(tanh(fc1(x)))`` (fc1 column-parallel with a bias, fc2 row-parallel, so that ZB-H1 can defer their
weight gradients), and on the last stage the output layer tied to the embedding plus cross entropy. Hidden states
are ``[s, b, h]``; with sequence parallelism each TP rank sees ``[s/tp, b, h]``.

The reference is a plain float64 torch function of the full weights, with no mcore code in it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mcore.parallel.comm import copy_to_tp_region, gather_from_sequence_parallel_region, group_rank, group_size
from mcore.parallel.pipeline import GPipe, NoPipelining, OneFOneB, ZeroBubbleH1
from mcore.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    attach_weight_grad_store,
    vocab_parallel_cross_entropy,
)
from mcore.parallel.weight_grad_store import WeightGradStore


@dataclass(frozen=True)
class Sizes:
    vocab: int = 32
    hidden: int = 16
    ffn: int = 32
    seq: int = 8
    micro_batch: int = 2
    layers: int = 8


SIZES = Sizes()
LR = 0.2
TOL = 1e-5


@dataclass(frozen=True)
class Microbatch:
    index: int
    ids: torch.Tensor  # [b, s]
    labels: torch.Tensor  # [b, s]


def full_weights(seed: int, sizes: Sizes = SIZES) -> dict[str, torch.Tensor]:
    """Every full tensor of the stack in float64, drawn from one seeded generator."""
    # Scales keep the loss near log(vocab) and the steps smooth, so that float32 rounding is not amplified
    # over the optimizer steps (the comparison is against float64).
    g = torch.Generator().manual_seed(seed)
    w = {"embedding.weight": 0.2 * torch.randn(sizes.vocab, sizes.hidden, generator=g, dtype=torch.float64)}
    for i in range(sizes.layers):
        w[f"layers.{i}.fc1.weight"] = torch.randn(sizes.ffn, sizes.hidden, generator=g, dtype=torch.float64)
        w[f"layers.{i}.fc1.weight"] /= math.sqrt(sizes.hidden)
        w[f"layers.{i}.fc1.bias"] = 0.1 * torch.randn(sizes.ffn, generator=g, dtype=torch.float64)
        w[f"layers.{i}.fc2.weight"] = torch.randn(sizes.hidden, sizes.ffn, generator=g, dtype=torch.float64)
        w[f"layers.{i}.fc2.weight"] *= 0.5 / math.sqrt(sizes.ffn)
    return w


def make_batch(seed: int, step: int, count: int, sizes: Sizes = SIZES) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and labels ``[count, b, s]`` for one optimizer step (identical on every rank)."""
    g = torch.Generator().manual_seed(seed * 1000 + step)
    shape = (count, sizes.micro_batch, sizes.seq)
    return torch.randint(0, sizes.vocab, shape, generator=g), torch.randint(0, sizes.vocab, shape, generator=g)


def reference(weights: dict[str, torch.Tensor], ids: torch.Tensor, labels: torch.Tensor, layers: int):
    """float64 losses of each micro-batch and the gradients of their mean, from the full weights."""
    p = {k: v.detach().clone().requires_grad_(True) for k, v in weights.items()}
    x = p["embedding.weight"][ids]
    for i in range(layers):
        x = (
            x
            + torch.tanh(x @ p[f"layers.{i}.fc1.weight"].T + p[f"layers.{i}.fc1.bias"]) @ p[f"layers.{i}.fc2.weight"].T
        )
    logits = x @ p["embedding.weight"].T
    per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
    losses = per_token.view(ids.shape).mean(dim=(1, 2))
    losses.mean().backward()
    return losses.detach(), {k: v.grad for k, v in p.items()}


def _rows(t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    n = t.shape[0] // size
    return t[rank * n : (rank + 1) * n]


def _cols(t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    n = t.shape[1] // size
    return t[:, rank * n : (rank + 1) * n]


class StackChunk(nn.Module):
    """Layers ``[start, end)`` of the stack, plus the embedding (``first``) and the tied output layer (``last``).

    ``local_view[name]`` maps a global tensor to this rank's slice, so that a rank can compare its parameters and
    gradients with the reference's.
    """

    def __init__(
        self,
        weights: dict[str, torch.Tensor],
        layer_range: tuple[int, int],
        *,
        first: bool,
        last: bool,
        tp_group=None,
        sequence_parallel: bool = False,
        sizes: Sizes = SIZES,
    ) -> None:
        super().__init__()
        self.first, self.last = first, last
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel
        tp, rank = group_size(tp_group), group_rank(tp_group)
        self.params_by_name: dict[str, nn.Parameter] = {}
        self.local_view: dict[str, object] = {}
        rows = lambda t: _rows(t, rank, tp)  # noqa: E731
        cols = lambda t: _cols(t, rank, tp)  # noqa: E731
        if first:
            self.embedding = VocabParallelEmbedding(
                sizes.vocab, sizes.hidden, tp_group=tp_group, sequence_parallel=sequence_parallel
            )
            self._load(self.embedding.weight, "embedding.weight", weights, rows)
        self.fc1 = nn.ModuleList()
        self.fc2 = nn.ModuleList()
        for i in range(*layer_range):
            fc1 = ColumnParallelLinear(
                sizes.hidden, sizes.ffn, tp_group=tp_group, bias=True, sequence_parallel=sequence_parallel
            )
            fc2 = RowParallelLinear(sizes.ffn, sizes.hidden, tp_group=tp_group, sequence_parallel=sequence_parallel)
            self._load(fc1.weight, f"layers.{i}.fc1.weight", weights, rows)
            self._load(fc1.bias, f"layers.{i}.fc1.bias", weights, rows)
            self._load(fc2.weight, f"layers.{i}.fc2.weight", weights, cols)
            self.fc1.append(fc1)
            self.fc2.append(fc2)
        self.output_weight = None
        if last and first:
            self.output_weight = self.embedding.weight  # truly tied: one tensor
        elif last:
            # The last stage's copy of the tied embedding; its gradient is summed with the first stage's over the
            # embedding group, so both copies take the same steps.
            self.output_weight = nn.Parameter(torch.empty(sizes.vocab // tp, sizes.hidden))
            with torch.no_grad():
                self.output_weight.copy_(rows(weights["embedding.weight"]))
            self.output_weight.tensor_parallel, self.output_weight.partition_dim = True, 0
            self.output_weight.shared_embedding = True
            self.params_by_name["embedding.weight@output"] = self.output_weight
            self.local_view["embedding.weight@output"] = rows
        if first and not last:
            self.embedding.weight.shared_embedding = True

    def _load(self, param: nn.Parameter, name: str, weights: dict[str, torch.Tensor], view) -> None:
        with torch.no_grad():
            param.copy_(view(weights[name]))
        self.params_by_name[name] = param
        self.local_view[name] = view

    def forward(self, hidden: torch.Tensor | None, mb: Microbatch) -> torch.Tensor:
        if self.first:
            hidden = self.embedding(mb.ids.t())  # [s, b, h], or [s/tp, b, h] with sequence parallelism
        for fc1, fc2 in zip(self.fc1, self.fc2):
            hidden = hidden + fc2(torch.tanh(fc1(hidden)))
        if not self.last:
            return hidden
        if self.sequence_parallel:
            full = gather_from_sequence_parallel_region(hidden, self.tp_group)
        else:
            full = copy_to_tp_region(hidden, self.tp_group)
        logits = (full @ self.output_weight.t()).transpose(0, 1)  # [b, s, V/tp]
        return vocab_parallel_cross_entropy(logits, mb.labels, self.tp_group).mean()


def global_name(name: str) -> str:
    return name.split("@")[0]


def sgd_step(chunks: list[nn.Module], lr: float = LR) -> None:
    """Plain SGD on this rank's parameters (``main_grad`` under DDP), then clear the gradients."""
    seen = set()
    with torch.no_grad():
        for chunk in chunks:
            for p in chunk.parameters():
                if id(p) in seen:
                    continue
                seen.add(id(p))
                p.add_(p.main_grad if hasattr(p, "main_grad") else p.grad, alpha=-lr)
                p.grad = None
            if hasattr(chunk, "zero_grad_buffer"):
                chunk.zero_grad_buffer()


def local_grad(p: torch.Tensor) -> torch.Tensor:
    return p.main_grad if hasattr(p, "main_grad") else p.grad


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative error in the 2-norm, measured in float64."""
    actual, expected = actual.detach().double().cpu(), expected.detach().double().cpu()
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def forward_step_of(chunks: list[nn.Module]):
    def forward_step(chunk_index: int, input_tensor: torch.Tensor | None, mb: Microbatch) -> torch.Tensor:
        return chunks[chunk_index](input_tensor, mb)

    return forward_step


# ----- single-process checks -------------------------------------------------------------------------------------


def _single_stage_errors(schedule_cls, m: int, steps: int = 3, seed: int = 7) -> tuple[float, float, float]:
    weights = full_weights(seed)
    chunk = StackChunk(weights, (0, SIZES.layers), first=True, last=True)
    schedule = schedule_cls([chunk], num_microbatches=m, activation_shape=(SIZES.seq, SIZES.micro_batch, SIZES.hidden))
    loss_err = grad_err = 0.0
    for step in range(steps):
        ids, labels = make_batch(seed, step, m)
        ref_losses, ref_grads = reference(weights, ids, labels, SIZES.layers)
        mbs = [Microbatch(k, ids[k], labels[k]) for k in range(m)]
        losses = schedule.run(forward_step_of([chunk]), mbs)
        loss_err = max(loss_err, rel_err(torch.stack(losses), ref_losses))
        for name, p in chunk.params_by_name.items():
            grad_err = max(grad_err, rel_err(local_grad(p), ref_grads[name]))
        sgd_step([chunk])
        weights = {k: v - LR * ref_grads[k] for k, v in weights.items()}
    param_err = max(rel_err(p, weights[n]) for n, p in chunk.params_by_name.items())
    assert getattr(schedule, "weight_grads", None) is None or schedule.weight_grads.pending() == 0
    return loss_err, grad_err, param_err


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("schedule_cls", [NoPipelining, GPipe, OneFOneB, ZeroBubbleH1])
def test_one_stage_matches_float64_reference(schedule_cls, m):
    loss_err, grad_err, param_err = _single_stage_errors(schedule_cls, m)
    assert loss_err <= TOL and grad_err <= TOL and param_err <= TOL, (loss_err, grad_err, param_err)


def test_forward_only_returns_losses_without_gradients():
    weights = full_weights(3)
    chunk = StackChunk(weights, (0, SIZES.layers), first=True, last=True)
    ids, labels = make_batch(3, 0, 2)
    schedule = NoPipelining([chunk], num_microbatches=2)
    losses = schedule.run(forward_step_of([chunk]), [Microbatch(k, ids[k], labels[k]) for k in range(2)], True)
    assert rel_err(torch.stack(losses), reference(weights, ids, labels, SIZES.layers)[0]) <= TOL
    assert all(p.grad is None for p in chunk.parameters())
    assert not any(loss.requires_grad for loss in losses)


def test_zero_bubble_defers_tensor_parallel_weight_gradients_until_w():
    """After B alone, the linears' weights have no gradient yet but the bias (not deferred) has; W fills it."""
    weights = full_weights(5)
    chunk = StackChunk(weights, (0, 2), first=True, last=True)
    ids, labels = make_batch(5, 0, 1)
    mb = Microbatch(0, ids[0], labels[0])
    store = WeightGradStore()
    assert attach_weight_grad_store([chunk], store) == 4  # fc1 and fc2 of each of the two layers
    with store.deferring():
        chunk(None, mb).backward()
    assert chunk.fc1[0].weight.grad is None and chunk.fc2[0].weight.grad is None
    assert chunk.fc1[0].bias.grad is not None
    assert store.flush(1) == 1 and store.pending() == 0
    assert chunk.fc1[0].weight.grad is not None and chunk.fc2[0].weight.grad is not None


def test_zero_bubble_refuses_a_store_with_foreign_work():
    weights = full_weights(5)
    chunk = StackChunk(weights, (0, 2), first=True, last=True)
    ids, labels = make_batch(5, 0, 1)
    schedule = ZeroBubbleH1([chunk], num_microbatches=1)
    with schedule.weight_grads.deferring():  # work queued outside the schedule's own passes
        chunk(None, Microbatch(0, ids[0], labels[0])).backward()
    with pytest.raises(RuntimeError, match="holds 1 queued"):
        schedule.run(forward_step_of([chunk]), [Microbatch(0, ids[0], labels[0])])
    schedule.weight_grads.clear()


def test_run_rejects_bad_inputs_with_the_numbers():
    weights = full_weights(1)
    chunk = StackChunk(weights, (0, 1), first=True, last=True)
    schedule = NoPipelining([chunk], num_microbatches=3)
    ids, labels = make_batch(1, 0, 3)
    with pytest.raises(ValueError, match="got 2 micro-batches .* num_microbatches=3"):
        schedule.run(forward_step_of([chunk]), [Microbatch(k, ids[k], labels[k]) for k in range(2)])
    with pytest.raises(ValueError, match=r"scalar loss, got \(2, 8\)"):
        schedule.run(lambda c, x, mb: torch.ones(2, 8, requires_grad=True), [None] * 3)
    with pytest.raises(TypeError, match="model_chunks must be a non-empty list"):
        NoPipelining(chunk, num_microbatches=1)
    with pytest.raises(ValueError, match="NoPipelining runs one stage .* pp=2"):
        NoPipelining.bubble_fraction(2, 1, 4)
