"""Multi-head latent attention (MLA, DeepSeek-V2/V3), the ``mla`` mixer.

Keys and values come from one small latent per token: ``kv_down`` maps ``x`` to ``[c_kv (kv_lora_rank);
k_rope (qk_rope_head_dim)]``; ``c_kv`` is normalised and ``kv_up`` expands it to every head's position-free key
(``qk_nope_head_dim``) and value (``v_head_dim``); ``k_rope`` is rotated once and shared by all heads (the
decoupled RoPE key). Queries are ``q_proj(x)`` or, with ``q_lora_rank``, ``q_up(q_norm(q_down(x)))``; each head's
last ``qk_rope_head_dim`` dims are rotated. Heads attend with q/k width ``qk_nope + qk_rope`` (192) and value width
``v_head_dim`` (128) through ``mcore.kernels.attention``.

Tensor parallelism splits the heads (``q_up``/``q_proj``/``kv_up`` column-parallel, ``out_proj`` row-parallel).
The down projections and their norms are small and feed every head, so every TP rank holds all of them
(replicated). Their gradient is complete on every rank without an extra reduction when the latents are replicated:
the up projections all-reduce the gradient of their input, and ``k_rope`` passes through ``copy_to_tp_region``
(the same all-reduce) before it meets the local heads. Under sequence parallelism the down projections run on the
rank's own tokens (``[s/tp]``, no gather of ``x``) and the latents are all-gathered instead (4% of ``x``'s width in
V3); their weights then see only local tokens, so they are marked ``sequence_parallel`` and
``finalize_model_grads`` all-reduces them over TP, as it does for the layer norms.

``recompute="selective"``: the up projections, the rotary step and the attention core are recomputed in backward,
so that only the latents (576 values per token in V3, against 128 x (192 + 192 + 128) for q/k/v) are kept. With
``recompute_modules`` (``mcore.models.recompute``): ``mla_up_proj`` alone discards q, k and v (the core keeps its
output and log-sum-exp, it does not run again), ``core_attn`` alone checkpoints the core on kept q, k, v, both
together are the default region above.
"""

from __future__ import annotations

import torch
from torch import nn

from mcore.kernels import apply_rotary, attention
from mcore.models.config import TransformerConfig
from mcore.models.layers.kv_cache import KVCache
from mcore.models.layers.norm import RMSNorm
from mcore.models.mla_fields import mla_softmax_scale, qk_head_dim
from mcore.models.parts.registry import PartContext, PartSpec
from mcore.models.recompute import checkpoint_region, discard_output
from mcore.models.rope import RopeTables
from mcore.parallel.comm import copy_to_tp_region, gather_from_sequence_parallel_region
from mcore.parallel.init import normal_init
from mcore.parallel.param_attrs import mark_sequence_parallel
from mcore.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear


class ReplicatedLinear(nn.Module):
    """``x W^T`` with the whole ``W`` on every TP rank (MLA's down projections); see the module doc for its grads."""

    def __init__(self, in_features: int, out_features: int, std: float, *, sequence_parallel: bool, dtype, device):
        super().__init__()
        self.std = std
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))
        mark_sequence_parallel(self.weight, sequence_parallel)

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        full = torch.empty(self.weight.shape).normal_(0.0, self.std, generator=generator)
        with torch.no_grad():
            self.weight.copy_(full)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight)


class MultiLatentAttention(nn.Module):
    """MLA on ``[s(/tp), b, h]``; see the module docstring. ``layer_index`` is the global index."""

    def __init__(self, config: TransformerConfig, layer_index: int, context: PartContext | None = None) -> None:
        super().__init__()
        ctx = PartContext() if context is None else context
        check_mla_tensor_parallel(config, ctx.tp_size)
        c = config
        self.layer_index = layer_index
        self.local_heads = c.num_attention_heads // ctx.tp_size
        self.nope, self.rope_dim, self.v_dim = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.kv_rank = c.kv_lora_rank
        self.softmax_scale = mla_softmax_scale(c)
        self.rope_interleave = c.rope_interleave
        self.recompute_up, self.recompute_core = ctx.recomputes("mla_up_proj"), ctx.recomputes("core_attn")
        self.tp_group, self.sequence_parallel = ctx.tp_group, ctx.sequence_parallel
        init = normal_init(c.initializer_range)
        factory = dict(params_dtype=ctx.params_dtype, device=ctx.device)
        column = dict(tp_group=ctx.tp_group, sequence_parallel=ctx.sequence_parallel, init_method=init, **factory)
        replicated = dict(sequence_parallel=ctx.sequence_parallel, dtype=ctx.params_dtype, device=ctx.device)
        q_out = c.num_attention_heads * qk_head_dim(c)
        if c.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(c.hidden_size, q_out, **column)
            self.q_down = self.q_norm = self.q_up = None
        else:
            self.q_proj = None
            self.q_down = ReplicatedLinear(c.hidden_size, c.q_lora_rank, c.initializer_range, **replicated)
            self.q_norm = RMSNorm(c.q_lora_rank, c.rms_norm_eps, sequence_parallel=ctx.sequence_parallel, **factory)
            self.q_up = ColumnParallelLinear(c.q_lora_rank, q_out, **column)
        self.kv_down = ReplicatedLinear(
            c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim, c.initializer_range, **replicated
        )
        self.kv_norm = RMSNorm(c.kv_lora_rank, c.rms_norm_eps, sequence_parallel=ctx.sequence_parallel, **factory)
        self.kv_up = ColumnParallelLinear(
            c.kv_lora_rank, c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim), **column
        )
        self.out_proj = RowParallelLinear(
            c.num_attention_heads * c.v_head_dim,
            c.hidden_size,
            input_is_parallel=True,
            tp_group=ctx.tp_group,
            sequence_parallel=ctx.sequence_parallel,
            init_method=init,
            **factory,
        )

    def forward(
        self,
        x: torch.Tensor,
        rope: RopeTables,
        *,
        cu_seqlens: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        context_parallel: object | None = None,
    ) -> torch.Tensor:
        """``x [s(/tp), b, h]``; ``rope`` the cos/sin tables ``[s, b, 1, qk_rope_head_dim]``."""
        if context_parallel is not None:
            raise ValueError(
                "multi-head latent attention under context parallelism (parallel.cp > 1) is not supported yet"
            )
        q_in = x if self.q_proj is not None else self.q_norm(self.q_down(x))
        kv_latent, k_rope = self.kv_down(x).split([self.kv_rank, self.rope_dim], dim=-1)
        kv_latent = self.kv_norm(kv_latent)
        # k_rope meets the local heads directly (no column-parallel layer in between): its gradient from each
        # rank's heads is partial, and this region sums it (or, under sequence parallelism, gathers the tokens).
        if self.sequence_parallel:
            k_rope = gather_from_sequence_parallel_region(k_rope, self.tp_group)
        else:
            k_rope = copy_to_tp_region(k_rope, self.tp_group)
        if kv_cache is not None:
            return self._forward_cached(q_in, kv_latent, k_rope, rope, kv_cache, cu_seqlens)
        out = self._recomputed_heads_and_core(q_in, kv_latent, k_rope, rope.cos, rope.sin, cu_seqlens)
        s, b = out.shape[1], out.shape[0]
        return self.out_proj(out.transpose(0, 1).reshape(s, b, -1))

    def _rotate(self, q_rope: torch.Tensor, k_rope: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Rotate ``q_rope [s, b, H, r]`` and the shared ``k_rope [s, b, r]`` (returned ``[s, b, 1, r]``)."""
        k_rope = k_rope.unsqueeze(2)
        if self.rope_interleave:
            # Pairs (x0, x1), (x2, x3)... become halves [x0, x2, ...; x1, x3, ...]: HF DeepSeek-V3 rotates them so
            # and returns that order; V2's complex rotation keeps the pairs, which gives the same q.k products.
            q_rope = torch.cat([q_rope[..., 0::2], q_rope[..., 1::2]], dim=-1)
            k_rope = torch.cat([k_rope[..., 0::2], k_rope[..., 1::2]], dim=-1)
        # the model's tables are [s, b, 1, r] (for grouped 5-D views); heads here are one dim: [s, b, r]
        return apply_rotary(q_rope, k_rope, cos.squeeze(2), sin.squeeze(2))

    def _queries(self, q_in: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Position-free and rotary parts of the local heads' queries, ``[s, b, H_local, .]`` (full sequence)."""
        q = self.q_up(q_in) if self.q_proj is None else self.q_proj(q_in)
        s, b = q.shape[:2]
        return q.view(s, b, self.local_heads, -1).split([self.nope, self.rope_dim], dim=-1)

    def _keys_values(self, q_nope, q_rope, kv_latent, k_rope):
        """q, k ``[b, s, H_local, qk_head_dim]`` and v ``[b, s, H_local, v_head_dim]`` from the rotated parts."""
        kv = self.kv_up(kv_latent)  # [s, b, .]: the whole sequence also under sequence parallelism
        kv = kv.view(*kv.shape[:2], self.local_heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, -1, self.local_heads, -1)], dim=-1)
        return q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)

    def _heads(self, q_in, kv_latent, k_rope, cos, sin):
        """The up-projections and the rotary step: q, k ``[b, s, H_local, qk]`` and v ``[b, s, H_local, v]``."""
        q_nope, q_rope = self._queries(q_in)
        q_rope, k_rope = self._rotate(q_rope, k_rope, cos, sin)
        return self._keys_values(q_nope, q_rope, kv_latent, k_rope)

    def _core(self, q, k, v, cu_seqlens):
        return attention(q, k, v, causal=True, softmax_scale=self.softmax_scale, cu_seqlens=cu_seqlens)

    def _heads_and_core(self, q_in, kv_latent, k_rope, cos, sin, cu_seqlens):
        return self._core(*self._heads(q_in, kv_latent, k_rope, cos, sin), cu_seqlens)

    def _recomputed_heads_and_core(self, q_in, kv_latent, k_rope, cos, sin, cu_seqlens):
        """``_heads_and_core`` with what ``recompute_up`` / ``recompute_core`` discard (see the module doc)."""
        if self.recompute_up and self.recompute_core:
            return checkpoint_region(self._heads_and_core, q_in, kv_latent, k_rope, cos, sin, cu_seqlens)
        if self.recompute_up:
            return discard_output(self._heads, (q_in, kv_latent, k_rope, cos, sin), lambda q, k, v: self._core(
                q, k, v, cu_seqlens))  # fmt: skip
        q, k, v = self._heads(q_in, kv_latent, k_rope, cos, sin)
        if self.recompute_core:
            return checkpoint_region(self._core, q, k, v, cu_seqlens)
        return self._core(q, k, v, cu_seqlens)

    def _forward_cached(self, q_in, kv_latent, k_rope, rope, cache: KVCache, cu_seqlens) -> torch.Tensor:
        """Inference with a cache of what MLA saves per token, ``[c_kv; rotated k_rope]`` (576 values in V3); the
        keys and values of every cached token are expanded again each step, as HF does."""
        if cu_seqlens is not None:
            raise ValueError("KV-cached attention does not take cu_seqlens (one sequence per batch row)")
        s, b = kv_latent.shape[:2]
        offset, end = cache.length, cache.length + s
        if offset and s != 1:
            raise ValueError(f"KV-cached attention after a prefill takes one new token per step, got {s}")
        if self.layer_index not in cache.states:
            cache.states[self.layer_index] = (kv_latent.new_empty(cache.max_length, b, self.kv_rank + self.rope_dim),)
        (buffer,) = cache.states[self.layer_index]
        if end > cache.max_length or b != buffer.shape[1]:
            raise ValueError(f"KVCache holds batch {buffer.shape[1]} x {cache.max_length} tokens; cannot add {b} x {s}")
        q_nope, q_rope = self._queries(q_in)
        q_rope, k_rope = self._rotate(q_rope, k_rope, rope.cos, rope.sin)
        buffer[offset:end] = torch.cat([kv_latent, k_rope.squeeze(2)], dim=-1)
        latents, k_rope_all = buffer[:end].split([self.kv_rank, self.rope_dim], dim=-1)
        # Attention pads keys with the cached ones: the queries are this call's tokens only.
        k_nope, v = self.kv_up(latents).view(end, b, self.local_heads, -1).split([self.nope, self.v_dim], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1).transpose(0, 1)
        k = torch.cat([k_nope, k_rope_all.unsqueeze(2).expand(-1, -1, self.local_heads, -1)], dim=-1).transpose(0, 1)
        out = attention(q, k, v.transpose(0, 1), causal=offset == 0, softmax_scale=self.softmax_scale)
        return self.out_proj(out.transpose(0, 1).reshape(s, b, -1))


def check_mla_tensor_parallel(config: TransformerConfig, tp: int) -> None:
    """TP splits the heads: ``tp`` must divide ``num_attention_heads``."""
    if config.num_attention_heads % tp:
        raise ValueError(
            f"tensor parallel size {tp} must divide num_attention_heads ({config.num_attention_heads}) for "
            "multi-head latent attention"
        )


def mla_matmul_weights(config: TransformerConfig, layer_index: int = 0) -> int:
    """Weights each token multiplies: query path, ``kv_down``, ``kv_up`` and the output projection."""
    c, heads = config, config.num_attention_heads
    q_out = heads * qk_head_dim(c)
    q = c.hidden_size * q_out if c.q_lora_rank is None else c.q_lora_rank * (c.hidden_size + q_out)
    kv = c.hidden_size * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank * heads * (
        c.qk_nope_head_dim + c.v_head_dim
    )
    return q + kv + heads * c.v_head_dim * c.hidden_size


def mla_parameters(config: TransformerConfig, layer_index: int = 0) -> int:
    """Matmul weights plus the two latent norms."""
    return mla_matmul_weights(config) + config.kv_lora_rank + (config.q_lora_rank or 0)


def mla_sequence_flops(config: TransformerConfig, layer_index: int, seq_len: int) -> float:
    """QK^T (qk_head_dim wide) and PV (v_head_dim wide), forward and backward: ``6 x heads x (qk + v) x seq`` per
    token (the attention term of the MLA FLOP formula; causal masks are not discounted, as for attention)."""
    return float(6 * config.num_attention_heads * (qk_head_dim(config) + config.v_head_dim) * seq_len)


MLA = PartSpec(
    name="mla",
    attribute="attention",
    build=MultiLatentAttention,
    parameters=mla_parameters,
    matmul_weights=mla_matmul_weights,
    check_tensor_parallel=check_mla_tensor_parallel,
    sequence_flops=mla_sequence_flops,
)
