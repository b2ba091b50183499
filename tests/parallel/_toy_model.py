"""A small transformer-like LM built from mcore.parallel layers, and the same network in plain torch.

``embedding -> [norm -> column -> gelu -> row (+ residual)] x L -> norm -> output -> cross entropy``.
Weights come from ``init_weights(seed)`` (each parameter's full tensor drawn from
``seeded_generator(seed, name)``), so the parallel model at any tp holds slices of the same full weights;
``reference_from`` copies those full weights into the plain model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mcore.parallel import (
    ColumnParallelLinear,
    ProcessGroups,
    RowParallelLinear,
    VocabParallelEmbedding,
    normal_init,
    seeded_generator,
    set_tensor_parallel_attributes,
    vocab_parallel_cross_entropy,
)


@dataclass(frozen=True)
class ToyConfig:
    vocab_padded: int = 48
    vocab_size: int = 45  # the last 3 rows/columns are padding
    hidden: int = 32
    ffn: int = 64
    layers: int = 2
    seq: int = 8


def _normal_(tensor: torch.Tensor, mean: float, std: float, generator: torch.Generator | None) -> None:
    """Fill ``tensor`` from ``generator``, drawing where the generator lives (the CPU) so that a CUDA model gets
    the values of the CPU one."""
    device = generator.device if generator is not None else tensor.device
    with torch.no_grad():
        tensor.copy_(
            torch.empty(tensor.shape, dtype=tensor.dtype, device=device).normal_(mean, std, generator=generator)
        )


def _norm_init(tensor: torch.Tensor, generator: torch.Generator | None) -> None:
    # random norm weights, so that a wrong gradient for them cannot hide behind an initial value of 1
    _normal_(tensor, 1.0, 0.1, generator)


class _Norm(nn.LayerNorm):
    """LayerNorm replicated over TP; under sequence parallelism it sees a sequence shard."""

    def __init__(self, hidden: int, sequence_parallel: bool, dtype: torch.dtype, device=None):
        super().__init__(hidden, dtype=dtype, device=device)
        for p in (self.weight, self.bias):
            set_tensor_parallel_attributes(p, tensor_parallel=False, sequence_parallel=sequence_parallel)

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:  # noqa: D102
        _norm_init(self.weight, generator)
        _normal_(self.bias, 0.0, 0.1, generator)


class _Block(nn.Module):
    def __init__(self, cfg: ToyConfig, groups: ProcessGroups, sp: bool, dtype: torch.dtype, device=None):
        super().__init__()
        kw = {"tp_group": groups.tp, "bias": True, "sequence_parallel": sp, "params_dtype": dtype, "device": device}
        self.norm = _Norm(cfg.hidden, sp, dtype, device)
        self.up = ColumnParallelLinear(cfg.hidden, cfg.ffn, **kw)
        self.down = RowParallelLinear(cfg.ffn, cfg.hidden, **kw)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(F.gelu(self.up(self.norm(h))))


class ParallelToyLM(nn.Module):
    def __init__(
        self,
        cfg: ToyConfig,
        groups: ProcessGroups,
        *,
        sequence_parallel: bool = False,
        dtype=torch.float32,
        device=None,
    ):
        super().__init__()
        self.cfg, self.groups = cfg, groups
        sp = sequence_parallel and groups.tp_size > 1
        self.embedding = VocabParallelEmbedding(
            cfg.vocab_padded,
            cfg.hidden,
            tp_group=groups.tp,
            sequence_parallel=sp,
            params_dtype=dtype,
            device=device,
            vocab_size=cfg.vocab_size,
            init_method=normal_init(1.0),
        )
        self.layers = nn.ModuleList(_Block(cfg, groups, sp, dtype, device) for _ in range(cfg.layers))
        self.final_norm = _Norm(cfg.hidden, sp, dtype, device)
        self.output = ColumnParallelLinear(
            cfg.hidden, cfg.vocab_padded, tp_group=groups.tp, sequence_parallel=sp, params_dtype=dtype, device=device
        )

    def init_weights(self, seed: int) -> None:
        modules = dict(self.named_modules())
        for name, _ in self.named_parameters():
            owner, _, leaf = name.rpartition(".")
            module = modules[owner]
            if leaf == "weight":  # one generator per module, named by its weight; biases are drawn with it
                module.reset_parameters(seeded_generator(seed, name))

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """ids, labels ``[b, s]`` -> per-token loss ``[b, s]`` (fp32)."""
        h = self.embedding(ids.t())  # [s, b, h] (sequence-sharded under sequence parallelism)
        for layer in self.layers:
            h = layer(h)
        logits = self.output(self.final_norm(h))  # [s, b, V/tp]
        loss = vocab_parallel_cross_entropy(logits, labels.t(), self.groups.tp, valid_vocab_size=self.cfg.vocab_size)
        return loss.t()


class ReferenceToyLM(nn.Module):
    """The same network from plain torch modules, in one process."""

    def __init__(self, cfg: ToyConfig):
        super().__init__()
        self.cfg = cfg
        self.embedding = nn.Embedding(cfg.vocab_padded, cfg.hidden)
        self.layers = nn.ModuleList(
            nn.ModuleDict(
                {
                    "norm": nn.LayerNorm(cfg.hidden),
                    "up": nn.Linear(cfg.hidden, cfg.ffn),
                    "down": nn.Linear(cfg.ffn, cfg.hidden),
                }
            )
            for _ in range(cfg.layers)
        )
        self.final_norm = nn.LayerNorm(cfg.hidden)
        self.output = nn.Linear(cfg.hidden, cfg.vocab_padded, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embedding(ids)
        for layer in self.layers:
            h = h + layer["down"](F.gelu(layer["up"](layer["norm"](h))))
        logits = self.output(self.final_norm(h))[..., : self.cfg.vocab_size]
        return F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")


def reference_from(full_model: ParallelToyLM, device=None) -> ReferenceToyLM:
    """A plain model holding ``full_model``'s weights (``full_model`` must be built at tp = 1)."""
    if full_model.groups.tp_size != 1:
        raise ValueError("reference_from needs the tp=1 build, which holds the full weights")
    ref = ReferenceToyLM(full_model.cfg)
    state = {k: v.detach().float().clone() for k, v in full_model.state_dict().items()}
    ref.load_state_dict(state, strict=True)
    return ref.to(device)


def batch(cfg: ToyConfig, step: int, global_batch: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5000 + step)
    ids = torch.randint(0, cfg.vocab_size, (global_batch, cfg.seq), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (global_batch, cfg.seq), generator=g)
    return ids.to(device), labels.to(device)
