"""Autoregressive generation with a KV cache: enough to check that a converted checkpoint still talks.

Runs at any tensor-parallel size with one pipeline stage. Every TP rank must call ``generate`` with the
same arguments (and, for sampling, a generator seeded the same way): the vocab-sharded logits of the last
position are gathered over TP, so each rank picks the same token.
"""

from __future__ import annotations

import torch

from mcore.models.gpt import GPTModel
from mcore.parallel.comm import gather_from_tp_region


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches ``top_p``; others get ``-inf``.

    The most likely token is always kept. ``logits`` is ``[..., V]``; a new tensor is returned.
    """
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_p == 1.0:
        # Everything is kept; the cumulative sum could round to 1 before the tail and drop it.
        return logits.clone()
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = sorted_logits.float().softmax(dim=-1)
    # A token is dropped when the tokens ranked above it already hold top_p of the mass.
    mass_before = probs.cumsum(dim=-1) - probs
    drop_sorted = mass_before >= top_p
    drop_sorted[..., 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def _check_generate_args(
    model: GPTModel, input_ids: torch.Tensor, max_new_tokens: int, temperature: float, top_p: float
) -> None:
    if not isinstance(model, GPTModel):
        raise TypeError(f"generate: model must be a GPTModel, got {type(model).__name__}")
    if not (model.pre_process and model.post_process):
        raise ValueError(
            "generate: the model must hold every layer, the embedding and the output layer (pipeline size 1); "
            f"got layer_range={model.layer_range}, pre_process={model.pre_process}, "
            f"post_process={model.post_process}"
        )
    if model.layer_range != (0, model.config.num_hidden_layers):
        raise ValueError(
            f"generate: the model must hold all {model.config.num_hidden_layers} layers, got {model.layer_range}"
        )
    if model.sequence_parallel:
        raise ValueError("generate: build the model with sequence_parallel=False (decoding feeds one token per step)")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
        raise ValueError(
            "generate: input_ids must be an integer tensor [batch, prompt_length] (prompts of equal length), got "
            f"{getattr(input_ids, 'dtype', type(input_ids).__name__)} {tuple(getattr(input_ids, 'shape', ()))}"
        )
    if input_ids.shape[1] < 1:
        raise ValueError("generate: prompts must hold at least one token")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if not temperature > 0:
        raise ValueError(f"generate: temperature must be > 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"generate: top_p must be in (0, 1], got {top_p}")


@torch.no_grad()
def generate(
    model: GPTModel,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
    eos_token_id: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Continue each prompt of ``input_ids [b, s]`` by up to ``max_new_tokens`` tokens; return ``[b, s + n]``.

    Greedy (``do_sample=False``) picks the most likely token, as Hugging Face ``generate(do_sample=False)``.
    Sampling divides the logits by ``temperature``, keeps the ``top_p`` nucleus and draws with
    ``generator``. After a row emits ``eos_token_id`` it is padded with it; generation stops early once
    every row has. Prompts share one length (no padding).
    """
    _check_generate_args(model, input_ids, max_new_tokens, temperature, top_p)
    batch, prompt_length = input_ids.shape
    vocab = model.config.vocab_size
    cache = model.make_kv_cache(batch, prompt_length + max_new_tokens)
    tokens = [input_ids]
    finished = torch.zeros(batch, dtype=torch.bool, device=input_ids.device)
    step_input = input_ids
    for step in range(max_new_tokens):
        local_logits = model(step_input, kv_cache=cache)[:, -1]
        logits = gather_from_tp_region(local_logits.contiguous(), model.tp_group)[:, :vocab].float()
        if do_sample:
            probs = top_p_filter(logits / temperature, top_p).softmax(dim=-1)
            next_token = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        else:
            next_token = logits.argmax(dim=-1)
        if eos_token_id is not None:
            next_token = next_token.masked_fill(finished, eos_token_id)
            finished |= next_token == eos_token_id
        tokens.append(next_token[:, None])
        if step + 1 == max_new_tokens or (eos_token_id is not None and bool(finished.all())):
            break
        step_input = next_token[:, None]
    return torch.cat(tokens, dim=1)
