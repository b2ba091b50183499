"""GPTModel: a decoder-only transformer, whole or one pipeline stage, built from mcore.parallel modules.

Hidden states are ``[s, b, h]`` (``[s/tp, b, h]`` under sequence parallelism); token ids, labels, position
ids and losses are ``[b, s]``. The model never calls a collective: the parallel modules it composes do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from mcore.models.config import TransformerConfig
from mcore.models.layers.block import DecoderLayer
from mcore.models.layers.embedding import build_embedding, build_output_layer, mask_padded_logits
from mcore.models.layers.kv_cache import KVCache
from mcore.models.layers.norm import build_norm
from mcore.models.mtp import MultiTokenPrediction
from mcore.models.parts.registry import NO_PART, PartContext
from mcore.models.recompute import check_recompute_modules, checkpoint_region
from mcore.models.rope import RopeTables, RotaryTables
from mcore.parallel.grid import ProcessGroups
from mcore.parallel.init import seeded_generator
from mcore.parallel.param_attrs import mark_shared_embedding
from mcore.parallel.tensor_parallel import ColumnParallelLinear, vocab_parallel_cross_entropy

RECOMPUTE_MODES = (None, "full", "selective")
IGNORE_INDEX = -100

if TYPE_CHECKING:  # the CP context lives in mcore.parallel; the model only calls it
    from mcore.parallel.cp_attention import CPContext


class GPTModel(nn.Module):
    """A decoder built from per-layer parts, or the pipeline stage holding layers ``layer_range = (start, end)``.

    ``pre_process`` adds the embedding (the stage reads token ids), ``post_process`` the final norm, the
    output layer and the loss. Parameter names are global (``layers.<global index>...``), so a stage's names
    are a subset of the whole model's. With tied embeddings the output layer multiplies by
    ``embedding.weight``; a last stage without the embedding holds its own copy of that parameter (same
    name, same initial values). Under pipeline parallelism both copies are marked ``shared_embedding`` (as
    ``finalize_model_grads`` expects), so their gradients are summed over the embedding group.

    ``recompute``: ``None``; ``"full"`` (each layer's activations are recomputed in backward) or
    ``"selective"`` (what each part chooses: attention recomputes its core; ``recompute_modules`` lists the
    sub-blocks instead, Megatron's names, see ``mcore.models.recompute``). The vocabulary is padded to a multiple of
    ``config.make_vocab_size_divisible_by * tp``; padded rows are tagged ``vocab_padded_dim``/``vocab_size``,
    never enter the loss and are masked to ``-inf`` in returned logits.
    """

    def __init__(
        self,
        config: TransformerConfig,
        *,
        groups: ProcessGroups | None = None,
        layer_range: tuple[int, int] | None = None,
        pre_process: bool = True,
        post_process: bool = True,
        sequence_parallel: bool = False,
        recompute: str | None = None,
        recompute_modules: Sequence[str] | None = None,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(config, TransformerConfig):
            raise TypeError(f"GPTModel: config must be a TransformerConfig, got {type(config).__name__}")
        if recompute not in RECOMPUTE_MODES:
            raise ValueError(f"GPTModel: recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
        recompute_modules = check_recompute_modules(recompute_modules, recompute, "GPTModel")
        groups = ProcessGroups.single() if groups is None else groups
        tp = groups.tp_size
        config.check_tensor_parallel(tp)
        start, end = _check_layer_range(layer_range, config.num_hidden_layers)

        self.config = config
        self.groups = groups
        self.tp_group = groups.tp
        self.layer_range = (start, end)
        self.pre_process = pre_process
        self.post_process = post_process
        self.sequence_parallel = sequence_parallel
        self.recompute = recompute
        self.padded_vocab_size = config.padded_vocab_size(tp)
        self.rotary = RotaryTables(config)

        factory = dict(params_dtype=params_dtype, device=device)
        parallel = dict(tp_group=self.tp_group, sequence_parallel=sequence_parallel, **factory)
        mtp = config.num_nextn_predict_layers > 0  # MTP modules look up the next tokens on the last stage
        if pre_process or (post_process and (config.tie_word_embeddings or mtp)):
            self.embedding = build_embedding(config, self.padded_vocab_size, **parallel)
            # Tied embeddings (or MTP's lookups) split over pipeline stages live twice (first stage: lookup, last
            # stage: output layer / MTP); finalize_model_grads sums the gradients of every copy marked shared_embedding.
            mark_shared_embedding(self.embedding.weight, (config.tie_word_embeddings or mtp) and groups.pp_size > 1)
        context = PartContext(
            tp_group=self.tp_group,
            tp_size=tp,
            sequence_parallel=sequence_parallel,
            recompute=recompute,
            recompute_modules=recompute_modules,
            groups=groups,
            **factory,
        )
        self.layers = nn.ModuleDict({str(i): DecoderLayer(config, i, context) for i in range(start, end)})
        self._tied_output: tuple[ColumnParallelLinear, ...] = ()
        if post_process:
            self.final_norm = build_norm(config, config.hidden_size, sequence_parallel=sequence_parallel, **factory)
            if config.tie_word_embeddings:
                # Kept outside the module tree (a tuple attribute), so that the shared weight has one name,
                # embedding.weight, in named_parameters() and state_dict() alike and is initialised once.
                self._tied_output = (
                    build_output_layer(config, self.padded_vocab_size, tied_weight=self.embedding.weight, **parallel),
                )
            else:
                self.output = build_output_layer(config, self.padded_vocab_size, **parallel)
        # DeepSeek-V3's multi-token prediction (mcore.models.mtp), trained with mtp_loss_weight (the trainer sets it)
        self.mtp = MultiTokenPrediction(config, context) if post_process and mtp else None
        self.mtp_loss_weight = 0.1

    # --- weights --------------------------------------------------------------------------------------

    def init_weights(self, seed: int) -> None:
        """Initialise every parameter from ``seed`` and its global name (identical full weights at any tp/pp).

        Each module owning parameters redraws them with ``reset_parameters(generator)``, the generator
        seeded by ``(seed, "<module name>.<first parameter name>")``.
        """
        done: set[int] = set()
        for module_name, module in self.named_modules():
            own = list(module.named_parameters(recurse=False))
            if not own:
                continue
            if not hasattr(module, "reset_parameters"):
                raise TypeError(f"GPTModel.init_weights: module {module_name!r} has parameters but no reset_parameters")
            module.reset_parameters(seeded_generator(seed, f"{module_name}.{own[0][0]}"))
            done.update(id(p) for _, p in own)
        missed = [name for name, p in self.named_parameters() if id(p) not in done]
        if missed:
            raise RuntimeError(f"GPTModel.init_weights left parameters uninitialised: {missed}")

    def make_kv_cache(self, batch_size: int, max_length: int) -> KVCache:
        """An empty KV cache for this model's layers (local KV heads), for ``generate``."""
        c = self.config
        ref = next(self.parameters())
        # Layers without attention need no key/value buffers (Mamba-2 keeps its state in ``KVCache.states``).
        recurrent_or_none = ("mamba2", "mla", NO_PART)  # MLA caches its latents in KVCache.states
        attends = [i for i in range(*self.layer_range) if c.mixer_type(i) not in recurrent_or_none]
        return KVCache(
            attends,
            batch_size,
            max_length,
            c.num_key_value_heads // self.groups.tp_size,
            c.head_dim,
            dtype=ref.dtype,
            device=ref.device,
        )

    # --- forward --------------------------------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        *,
        hidden_states: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        context_parallel: CPContext | None = None,
        mtp_input_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run this stage.

        First stage: ``input_ids [b, s]``; other stages: ``hidden_states [s, b, h]`` (``[s/tp, b, h]`` with
        sequence parallelism). ``position_ids [b, s]`` default to ``0..s-1`` per row, or, with ``cu_seqlens``
        (int32 document boundaries over the flattened ``b * s`` tokens), restart at 0 in every document.
        Returns: on the last stage the per-token loss ``[b, s]`` fp32 (0 where ``labels == -100``) if
        ``labels`` are given, else logits ``[b, s, V_pad / tp]`` (a transposed view of ``[s, b, ...]``);
        elsewhere the hidden states to send on. ``kv_cache`` (inference only, see ``generate``) appends
        this call's keys/values and positions the tokens after the cached ones. ``context_parallel`` (an
        ``mcore.parallel.cp_attention.CPContext``): the inputs are this rank's CP shard (its sharding's
        ``shard``), documents and positions come from the sharding, attention spans the CP group.
        ``mtp_input_ids [b, s]``: the micro-batch's tokens, which a last stage with MTP modules needs when it is not
        also the first (with ``labels`` the MTP loss joins the returned loss's backward; see ``mcore.models.mtp``).
        """
        if kv_cache is not None and (labels is not None or cu_seqlens is not None or self.sequence_parallel):
            raise ValueError("GPTModel: kv_cache is for inference: no labels, no cu_seqlens, no sequence parallel")
        if context_parallel is not None and (cu_seqlens is not None or kv_cache is not None):
            raise ValueError(
                "GPTModel: with context_parallel the documents come from its sharding; pass no cu_seqlens or kv_cache"
            )
        x, b, s = self._embed(input_ids, hidden_states)
        if context_parallel is not None and position_ids is None:
            position_ids = context_parallel.positions(x.device)
        rope = self.rotary(self._position_ids(position_ids, cu_seqlens, b, s, x.device, kv_cache))
        x = self._run_layers(x, rope, cu_seqlens, kv_cache, context_parallel)
        if kv_cache is not None:
            kv_cache.advance(s)
        if not self.post_process:
            return x
        out = self._head(x, labels, b, s)
        if self.mtp is None or labels is None:
            return out
        if context_parallel is not None:
            raise ValueError("GPTModel: multi-token prediction under context parallelism is not supported")
        ids = input_ids if mtp_input_ids is None else mtp_input_ids
        if ids is None or tuple(ids.shape) != (b, s):
            raise ValueError(f"GPTModel: a last stage with MTP modules needs mtp_input_ids [b, s] = [{b}, {s}]")
        return self.mtp.attach(out, self.mtp.loss(self, x, ids, labels, rope, cu_seqlens, self.mtp_loss_weight))

    def _embed(
        self, input_ids: torch.Tensor | None, hidden_states: torch.Tensor | None
    ) -> tuple[torch.Tensor, int, int]:
        """This stage's input ``[s(/tp), b, h]`` and the micro-batch's ``b`` and full ``s``."""
        tp = self.groups.tp_size
        if self.pre_process:
            if input_ids is None or hidden_states is not None:
                raise ValueError("GPTModel: the first pipeline stage takes input_ids [b, s] and no hidden_states")
            if input_ids.dim() != 2 or input_ids.is_floating_point():
                raise ValueError(
                    f"GPTModel: input_ids must be an integer tensor [b, s], got {input_ids.dtype} "
                    f"of shape {tuple(input_ids.shape)}"
                )
            b, s = input_ids.shape
            if self.sequence_parallel and s % tp != 0:
                raise ValueError(f"GPTModel: sequence parallelism needs s ({s}) divisible by tp ({tp})")
            return self.embed_tokens(input_ids), b, s  # (with Falcon-H1's muP embedding multiplier)
        if hidden_states is None or input_ids is not None:
            raise ValueError("GPTModel: a later pipeline stage takes hidden_states [s, b, h] and no input_ids")
        if hidden_states.dim() != 3 or hidden_states.shape[-1] != self.config.hidden_size:
            raise ValueError(
                f"GPTModel: hidden_states must be [s, b, {self.config.hidden_size}], got {tuple(hidden_states.shape)}"
            )
        s = hidden_states.shape[0] * (tp if self.sequence_parallel else 1)
        return hidden_states, hidden_states.shape[1], s

    def _run_layers(
        self,
        x: torch.Tensor,
        rope: RopeTables,
        cu_seqlens: torch.Tensor | None,
        kv_cache: KVCache | None,
        context_parallel: CPContext | None = None,
    ) -> torch.Tensor:
        for layer in self.layers.values():
            if self.recompute == "full" and torch.is_grad_enabled():
                # the recomputed forward must not count an MoE layer's tokens again (checkpoint_region restores them)
                x = checkpoint_region(layer, x, rope, cu_seqlens, None, context_parallel, state=layer)
            else:
                x = layer(x, rope, cu_seqlens, kv_cache, context_parallel)
        return x

    def _head(self, x: torch.Tensor, labels: torch.Tensor | None, b: int, s: int) -> torch.Tensor:
        """Final norm and output layer: logits ``[b, s, V_pad / tp]`` or, with ``labels``, the loss ``[b, s]``."""
        if labels is None:
            logits = self._logits(self.final_norm(x))  # [s, b, V_pad / tp]
            return mask_padded_logits(logits, self.config.vocab_size, self.groups.tp_rank).transpose(0, 1)
        return self.token_losses(self.final_norm(x), labels, b, s)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[s(/tp), b, h]`` embeddings of ``input_ids [b, s]`` (the first stage's lookup; MTP's on the last)."""
        x = self.embedding(input_ids.t())
        return x if self.config.embedding_multiplier == 1.0 else x * self.config.embedding_multiplier

    def token_losses(self, normed: torch.Tensor, labels: torch.Tensor, b: int, s: int) -> torch.Tensor:
        """Per-token cross entropy ``[b, s]`` fp32 (0 where ``labels == -100``) of normed hidden states."""
        logits = self._logits(normed)
        if tuple(labels.shape) != (b, s):
            raise ValueError(f"GPTModel: labels must be [b, s] = [{b}, {s}], got {tuple(labels.shape)}")
        loss = vocab_parallel_cross_entropy(
            logits,
            labels.t(),
            self.tp_group,
            ignore_index=IGNORE_INDEX,
            valid_vocab_size=self.config.vocab_size,
        )
        return loss.t().contiguous()

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        output = self._tied_output[0] if self._tied_output else self.output
        logits = output(x)
        return logits if self.config.lm_head_multiplier == 1.0 else logits * self.config.lm_head_multiplier

    def _position_ids(
        self,
        position_ids: torch.Tensor | None,
        cu_seqlens: torch.Tensor | None,
        b: int,
        s: int,
        device: torch.device,
        kv_cache: KVCache | None,
    ) -> torch.Tensor:
        if position_ids is not None:
            if tuple(position_ids.shape) != (b, s) or position_ids.is_floating_point():
                raise ValueError(
                    f"GPTModel: position_ids must be integer [b, s] = [{b}, {s}], got {position_ids.dtype} "
                    f"of shape {tuple(position_ids.shape)}"
                )
            return position_ids
        offset = 0 if kv_cache is None else kv_cache.length
        if cu_seqlens is None:
            return torch.arange(offset, offset + s, device=device).expand(b, s)
        # Packed documents: each token's position counts from its document's first token.
        tokens = torch.arange(b * s, device=device, dtype=cu_seqlens.dtype)
        doc = torch.searchsorted(cu_seqlens, tokens, right=True) - 1
        return (tokens - cu_seqlens[doc]).view(b, s)


def _check_layer_range(layer_range: tuple[int, int] | None, num_layers: int) -> tuple[int, int]:
    if layer_range is None:
        return 0, num_layers
    try:
        start, end = (int(v) for v in layer_range)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"GPTModel: layer_range must be a (start, end) pair of ints, got {layer_range!r}") from exc
    if not 0 <= start <= end <= num_layers:
        raise ValueError(
            f"GPTModel: layer_range {layer_range!r} must satisfy 0 <= start <= end <= num_hidden_layers ({num_layers})"
        )
    return start, end
