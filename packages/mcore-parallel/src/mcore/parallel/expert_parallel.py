"""Mixture-of-experts layer with expert parallelism (``ep``) and expert tensor parallelism (``etp``).

Parallel folding (Megatron-Core): attention uses the dense grid tp x cp x dp while the experts use the expert
grid etp x ep x edp over the same ranks (``grid.py``), so ep is not capped by dp. Each rank routes its own
tokens; the dispatcher (``expert_dispatch``) moves them to the ranks holding their experts.

* The router's weight is a dense parameter (replicated, reduced over dp like any other).
* Expert weights carry ``expert_parallel = True``: DDP reduces them over the expert-data-parallel group
  (scaled by ``1 / dense dp size``, because each replica sums the contributions of every rank of its ep group)
  and the gradient norm counts each once (``grad_clip``). With etp > 1 they also carry ``tensor_parallel``.
* The aux-loss-free bias (``expert_bias``, a buffer outside the optimizer) is updated once per step by
  :func:`update_expert_biases`, which ``finalize_model_grads`` calls.
* Auxiliary losses (load balancing, z-loss) join the training loss through their gradient: the layer's output
  carries them (``_AttachAuxLoss``), so they need no path through the pipeline schedule; their values are kept
  in ``layer.stats`` for logging.

With every group ``None`` the layer is an ordinary single-process MoE.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function

from mcore.kernels import swiglu
from mcore.kernels.moe import (
    RouterConfig,
    expert_bias_update,
    grouped_gemm,
    grouped_gemm_of_activation,
    route,
    tokens_per_expert,
)
from mcore.parallel.comm import group_rank, group_size
from mcore.parallel.expert_dispatch import DISPATCHERS, AllGatherDispatcher, AllToAllDispatcher
from mcore.parallel.expert_gemm import (
    ExpertGemms,
    HostOffsets,
    expert_wgrad_into,
    per_expert_linear,
    per_expert_linear_of_activation,
)
from mcore.parallel.grid import ProcessGroups
from mcore.parallel.moe_aux_losses import moe_aux_losses
from mcore.parallel.tensor_parallel import set_tensor_parallel_attributes
from mcore.parallel.weight_grad_store import DefersWeightGrads, WeightGradStore

__all__ = ["GroupedExperts", "MoEConfig", "MoELayer", "Router", "moe_metrics", "update_expert_biases"]

_AUX_LOSS_TYPES = ("micro_batch", "sequence")
# grouped: torch._grouped_mm for all three GEMMs; per_expert: one cuBLAS GEMM per expert for all three;
# grouped_fp32_wgrad: grouped forward and input-gradient GEMMs, the weight gradients one GEMM per expert accumulating
# in fp32 into main_grad (the offsets' host copy starts in forward and is waited for in backward: no stall)
EXPERT_GEMMS = ("grouped", "per_expert", "grouped_fp32_wgrad")
PER_EXPERT_WGRAD = "grouped_fp32_wgrad"


def squared_relu(h: torch.Tensor) -> torch.Tensor:
    """``relu(h)^2``: Nemotron-H's non-gated expert activation."""
    return torch.relu(h).square()


# the experts' activation -> (function of the input projection's output, whether it is gated: gate rows + up rows)
EXPERT_ACTIVATIONS = {"swiglu": (swiglu, True), "relu2": (squared_relu, False)}


@dataclass(frozen=True)
class MoEConfig:
    """One MoE layer: the router (see ``mcore.kernels.moe.RouterConfig``), the experts and the dispatch.

    ``capacity_factor=None`` is dropless; ``align`` pads each expert's rows (16 for FP8 grouped GEMMs);
    ``aux_loss_type`` ``"micro_batch"`` or ``"sequence"`` (per sequence, hidden states ``[s, b, h]``).
    ``expert_bias`` enables aux-loss-free balancing with step ``bias_update_rate``. ``expert_gemm``: ``"grouped"``
    (``torch._grouped_mm``, no host sync), ``"per_expert"`` (one cuBLAS GEMM per expert, fp32 weight gradients
    straight into ``main_grad``; one host sync per layer; for a few large experts, see ``expert_gemm.py``) or
    ``"grouped_fp32_wgrad"`` (grouped forward and input gradients, per-expert fp32 weight gradients into
    ``main_grad`` from offsets copied to the host during forward: no bf16 gradient copied into ``main_grad``).
    ``activation``: the experts' ``"swiglu"`` (gated) or ``"relu2"`` (Nemotron-H's non-gated squared ReLU); set by the
    MLP part (``moe`` / ``moe_relu2``), not a ``moe_router`` knob.
    """

    hidden_size: int
    num_experts: int
    topk: int
    moe_intermediate_size: int
    score_function: str = "softmax"
    softmax_before_topk: bool = True
    norm_topk_prob: bool = False
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    group_score: str = "top2_sum"
    expert_bias: bool = False
    bias_update_rate: float = 1e-3
    aux_loss_coef: float = 0.0
    aux_loss_type: str = "micro_batch"
    z_loss_coef: float = 0.0
    capacity_factor: float | None = None
    drop_policy: str = "position"
    pad_to_capacity: bool = False
    align: int = 1
    dispatcher: str = "alltoall"
    expert_gemm: str = "grouped"
    activation: str = "swiglu"

    def __post_init__(self) -> None:
        for name in ("hidden_size", "moe_intermediate_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MoEConfig.{name} must be a positive int, got {value!r}")
        self.router_config()  # validates the routing fields
        if self.expert_gemm not in EXPERT_GEMMS:
            raise ValueError(f"MoEConfig.expert_gemm must be one of {EXPERT_GEMMS}, got {self.expert_gemm!r}")
        if self.activation not in EXPERT_ACTIVATIONS:
            valid = list(EXPERT_ACTIVATIONS)
            raise ValueError(f"MoEConfig.activation must be one of {valid}, got {self.activation!r}")
        if self.dispatcher not in DISPATCHERS:
            raise ValueError(f"MoEConfig.dispatcher must be one of {DISPATCHERS}, got {self.dispatcher!r}")
        if self.dispatcher == "allgather" and self.capacity_factor is not None:
            raise ValueError("MoEConfig: the allgather dispatcher is dropless; set capacity_factor=None")
        if self.aux_loss_type not in _AUX_LOSS_TYPES:
            raise ValueError(f"MoEConfig.aux_loss_type must be one of {_AUX_LOSS_TYPES}, got {self.aux_loss_type!r}")
        for name in ("aux_loss_coef", "z_loss_coef", "bias_update_rate"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"MoEConfig.{name} must be >= 0, got {getattr(self, name)}")

    def router_config(self) -> RouterConfig:
        return RouterConfig(
            num_experts=self.num_experts,
            topk=self.topk,
            score_function=self.score_function,
            softmax_before_topk=self.softmax_before_topk,
            norm_topk_prob=self.norm_topk_prob,
            n_group=self.n_group,
            topk_group=self.topk_group,
            routed_scaling_factor=self.routed_scaling_factor,
            group_score=self.group_score,
        )

    def check_layout(self, ep: int, etp: int) -> None:
        """Raise ``ValueError`` naming the valid values when experts or their FFN cannot be split."""
        if self.num_experts % ep:
            valid = [d for d in range(1, self.num_experts + 1) if self.num_experts % d == 0]
            raise ValueError(f"num_experts={self.num_experts} not divisible by ep={ep}; valid ep: {valid}")
        if self.moe_intermediate_size % etp:
            f = self.moe_intermediate_size
            valid = [d for d in (1, 2, 4, 8, 16, 32, 64) if f % d == 0]
            raise ValueError(f"moe_intermediate_size={f} not divisible by etp={etp}; valid etp: {valid}")


def _expert_generators(generator: torch.Generator | None, count: int, first: int) -> list[torch.Generator | None]:
    """One generator per global expert ``first .. first + count - 1``, from one draw of ``generator``: each rank
    draws only its own experts, and the same expert gets the same weights at any ep."""
    if generator is None:
        return [None] * count
    base = int(torch.randint(0, 2**62, (1,), generator=generator))
    return [torch.Generator().manual_seed(base + first + e) for e in range(count)]


class Router(nn.Module):
    """The router's ``[E, H]`` weight (a dense parameter, replicated over every rank)."""

    def __init__(self, hidden_size: int, num_experts: int, *, init_std: float = 0.02, params_dtype=None, device=None):
        super().__init__()
        self.init_std = init_std
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=params_dtype, device=device))
        set_tensor_parallel_attributes(self.weight, tensor_parallel=False)

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        full = torch.empty(self.weight.shape, dtype=torch.float32).normal_(0.0, self.init_std, generator=generator)
        with torch.no_grad():
            self.weight.copy_(full)

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """fp32 ``[T, E]`` router logits of ``tokens`` [T, H] (a subclass may add a bias: GPT-OSS)."""
        return router_logits(tokens, self.weight)


class GroupedExperts(DefersWeightGrads, nn.Module):
    """``E_local`` experts as two stacked weights run with one grouped GEMM each: the input projection, then the
    activation, then ``down`` [E_local, H, F/etp].

    ``activation="swiglu"`` (gated): the input projection is ``gate_up`` [E_local, 2F/etp, H], this etp rank's gate
    rows then its up rows. ``activation="relu2"`` (Nemotron-H, non-gated squared ReLU): it is ``up`` [E_local, F/etp,
    H]. Either way ``input_weight`` names it, and the activation's output is recomputed in backward, not kept.
    """

    def __init__(
        self,
        num_local_experts: int,
        hidden_size: int,
        ffn_size: int,
        *,
        etp: int = 1,
        etp_rank: int = 0,
        first_expert: int = 0,
        init_std: float = 0.02,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        gemm: str = "grouped",
        activation: str = "swiglu",
    ) -> None:
        super().__init__()
        if activation not in EXPERT_ACTIVATIONS:
            valid = list(EXPERT_ACTIVATIONS)
            raise ValueError(f"GroupedExperts: activation must be one of {valid}, got {activation!r}")
        local_ffn = ffn_size // etp
        self.gemm, self.activation_name = gemm, activation
        self.activation_fn, self.gated = EXPERT_ACTIVATIONS[activation]
        self.ffn_size, self.etp, self.etp_rank = ffn_size, etp, etp_rank
        self.first_expert, self.init_std = first_expert, init_std
        kw = dict(dtype=params_dtype, device=device)
        self.input_name = "gate_up" if self.gated else "up"
        width = 2 * local_ffn if self.gated else local_ffn
        setattr(self, self.input_name, nn.Parameter(torch.empty(num_local_experts, width, hidden_size, **kw)))
        self.down = nn.Parameter(torch.empty(num_local_experts, hidden_size, local_ffn, **kw))
        # the FFN width is split over etp like a column- then row-parallel pair (the layout checkpoints read)
        blocks = (ffn_size, ffn_size) if self.gated else None
        set_tensor_parallel_attributes(
            self.input_weight, tensor_parallel=etp > 1, partition_dim=1, partition_blocks=blocks
        )
        set_tensor_parallel_attributes(self.down, tensor_parallel=etp > 1, partition_dim=2)
        for p in (self.input_weight, self.down):
            p.expert_parallel = True
        # fp8 grouped GEMMs, set by mcore.parallel.low_precision (None: bf16); they replace every expert_gemm mode
        self.low_precision: ExpertGemms | None = None
        # set by attach_weight_grad_store (a zero-bubble schedule's queue of deferred weight gradients); the GEMMs
        # ask self.defer in backward whether to queue their weight gradients there
        self.weight_grad_store: WeightGradStore | None = None

    @property
    def input_weight(self) -> nn.Parameter:
        """The input projection: ``gate_up`` (gated) or ``up``."""
        return getattr(self, self.input_name)

    @torch.no_grad()
    def load_full_experts(self, input_weight: torch.Tensor, down: torch.Tensor) -> None:
        """Copy this rank's slice of its experts' full input projection (``gate_up`` [E_local, 2F, H], gate rows then
        up rows, or ``up`` [E_local, F, H]) and ``down`` [E_local, H, F]."""
        f, fl = self.ffn_size, self.ffn_size // self.etp
        cols = slice(self.etp_rank * fl, (self.etp_rank + 1) * fl)
        if self.gated:
            self.input_weight.copy_(torch.cat((input_weight[:, :f][:, cols], input_weight[:, f:][:, cols]), dim=1))
        else:
            self.input_weight.copy_(input_weight[:, cols])
        self.down.copy_(down[:, :, cols])

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Normal(0, init_std) full experts, one generator per global expert, sliced for etp."""
        experts, h = self.input_weight.shape[0], self.input_weight.shape[2]
        gens = _expert_generators(generator, experts, self.first_expert)
        f, std = self.ffn_size, self.init_std
        width = 2 * f if self.gated else f
        first = torch.stack([torch.empty(width, h).normal_(0.0, std, generator=g) for g in gens])
        down = torch.stack([torch.empty(h, f).normal_(0.0, std, generator=g) for g in gens])
        self.load_full_experts(first, down)

    @property
    def wants_host_offsets(self) -> bool:
        """Whether forward needs the offsets on the host (per-expert GEMMs): the dispatcher then starts their copy
        early and passes ``host_offsets``. Never with fp8 experts: their grouped GEMMs read the offsets on the
        device."""
        return self.gemm in ("per_expert", PER_EXPERT_WGRAD) and self.low_precision is None

    def forward(
        self,
        rows: torch.Tensor,
        offsets: torch.Tensor,
        tail_rows: int | None = None,
        host_offsets: HostOffsets | None = None,
    ) -> torch.Tensor:
        """``tail_rows``: at most that many last rows lie past ``offsets[-1]`` (``None``: unknown), see
        ``grouped_gemm``; ``host_offsets``: ``offsets`` on their way to the host (per-expert GEMMs; ``None``: copied
        here)."""
        w_in, act, defer = self.input_weight, self.activation_fn, self.defer
        rows = rows.to(w_in.dtype)
        if self.low_precision is not None:
            # fp8 experts (mcore.parallel.low_precision): both GEMMs quantized, weight gradients into main_grad and
            # the activation recomputed as in the grouped mode below; the expert_gemm mode does not apply (fp8
            # grouped GEMMs only: no per-expert GEMMs, no host offsets)
            fp8, into = self.low_precision, expert_wgrad_into(self.down)
            kw = {"tail_rows": tail_rows, "defer": defer, "weight_casts": fp8.weight_casts}
            h = fp8.gemm(rows, w_in, offsets, wgrad_into=expert_wgrad_into(w_in), **kw)
            return fp8.of_activation(h, self.down, offsets, act, wgrad_into=into, **kw)
        if self.gemm == "per_expert":
            bounds = (host_offsets or HostOffsets.start(offsets)).bounds()  # the host sync of this mode
            h = per_expert_linear(rows, w_in, bounds, defer)
            return per_expert_linear_of_activation(h, self.down, bounds, act, defer)
        # weight gradients go into main_grad (written on a step's first micro-batch, added after), not returned;
        # grouped_fp32_wgrad: by one fp32-accumulating GEMM per expert, from offsets copied to the host meanwhile
        host = (host_offsets or HostOffsets.start(offsets)) if self.gemm == PER_EXPERT_WGRAD else None
        into = expert_wgrad_into(w_in, host)
        h = grouped_gemm(rows, w_in, offsets, tail_rows=tail_rows, wgrad_into=into, defer=defer)
        # the activation's output ([rows, F/etp]) is recomputed in backward rather than kept
        into = expert_wgrad_into(self.down, host)
        return grouped_gemm_of_activation(h, self.down, offsets, act, tail_rows=tail_rows, wgrad_into=into,
                                          defer=defer)  # fmt: skip


class _RouterLogits(torch.autograd.Function):
    """fp32 ``x @ w.T`` from ``x`` in the model's dtype, saving ``x`` as it is (not its fp32 copy: tokens x hidden x 4
    bytes per layer) and upcasting it again in backward; the same numbers as ``F.linear(x.float(), w.float())``."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return F.linear(x.float(), weight.float())

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        dx = grad.matmul(weight.float()).to(x.dtype) if ctx.needs_input_grad[0] else None
        dw = grad.t().matmul(x.float()).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return dx, dw


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The router's fp32 logits ``[T, E]`` of tokens ``x`` [T, H] (any float dtype) and ``weight`` [E, H]."""
    return _RouterLogits.apply(x, weight)


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on ``out``; in backward, ``aux`` receives the gradient ``scale`` (d loss / d aux)."""

    @staticmethod
    def forward(ctx, out, aux, scale):
        ctx.scale = scale
        ctx.aux_meta = (aux.shape, aux.dtype, aux.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.aux_meta
        return grad, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


class MoELayer(nn.Module):
    """Router + dispatcher + grouped experts: ``[..., H] -> [..., H]`` (hidden states ``[s, b, h]`` in mcore).

    ``groups`` supplies ``ep`` / ``etp`` (``None``: one process); ``token_split_group``: ranks that split the same
    tokens between them (tp under sequence parallelism), over which the aux losses are computed. Weights:
    ``router.weight`` [E, H],
    ``experts.gate_up`` / ``experts.down`` this rank's slices; :meth:`load_full_weights` fills them from the full
    tensors (the same full weights at any layout). ``aux_loss_scale`` multiplies the aux losses' gradient (set
    it to the main loss's scale, e.g. ``1 / micro-batches``). ``stats`` holds the last forward's detached
    ``tokens_per_expert``, ``dropped``, ``aux_loss`` and ``z_loss``.
    """

    def __init__(
        self,
        config: MoEConfig,
        *,
        groups: ProcessGroups | None = None,
        init_std: float = 0.02,
        token_split_group: dist.ProcessGroup | None = None,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        groups = groups or ProcessGroups.single()
        self.token_split_group = token_split_group
        ep_group, etp_group = groups.ep, groups.etp
        self.ep, self.etp = group_size(ep_group), group_size(etp_group)
        self.ep_rank, self.etp_rank = group_rank(ep_group), group_rank(etp_group)
        config.check_layout(self.ep, self.etp)
        self.config = config
        self.router_config = config.router_config()
        self.num_local_experts = config.num_experts // self.ep
        self.router = Router(
            config.hidden_size, config.num_experts, init_std=init_std, params_dtype=params_dtype, device=device
        )
        self.experts = GroupedExperts(
            self.num_local_experts,
            config.hidden_size,
            config.moe_intermediate_size,
            etp=self.etp,
            etp_rank=self.etp_rank,
            first_expert=self.ep_rank * self.num_local_experts,
            init_std=init_std,
            params_dtype=params_dtype,
            device=device,
            gemm=config.expert_gemm,
            activation=config.activation,
        )
        dispatcher_cls = AllToAllDispatcher if config.dispatcher == "alltoall" else AllGatherDispatcher
        self.dispatcher = dispatcher_cls(config.num_experts, ep_group, etp_group)
        if config.expert_bias:
            self.register_buffer("expert_bias", torch.zeros(config.num_experts, dtype=torch.float32, device=device))
            # tokens per expert summed over the micro-batches of the step (read by update_expert_biases)
            self.register_buffer("step_tokens_per_expert", torch.zeros_like(self.expert_bias), persistent=False)
        else:
            self.expert_bias = None
        self.aux_loss_scale = 1.0
        self.stats: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def load_full_weights(self, router: torch.Tensor, input_weight: torch.Tensor, down: torch.Tensor) -> None:
        """Copy this rank's slices of the full ``router`` [E, H], the experts' input projection (``gate_up``
        [E, 2F, H], gate rows then up rows, HF's ``gate_up_proj`` layout; ``up`` [E, F, H] for relu2) and ``down``
        [E, H, F]."""
        e0 = self.ep_rank * self.num_local_experts
        experts = slice(e0, e0 + self.num_local_experts)
        self.router.weight.copy_(router)
        self.experts.load_full_experts(input_weight[experts], down[experts])

    def forward(self, x: torch.Tensor, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``padding_mask`` (bool, ``x.shape[:-1]``, True: a padding token, e.g. context parallelism's per-document
        padding): those tokens are routed and dispatched as any (their outputs are out of the loss) but left out of
        the tokens per expert (so of the expert-bias update) and of the aux and z losses' statistics."""
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        if padding_mask is not None:
            if not isinstance(padding_mask, torch.Tensor) or tuple(padding_mask.shape) != tuple(shape[:-1]):
                got = tuple(padding_mask.shape) if isinstance(padding_mask, torch.Tensor) else type(padding_mask)
                raise ValueError(f"MoELayer: padding_mask must be a bool tensor {tuple(shape[:-1])}, got {got}")
            padding_mask = padding_mask.reshape(-1)
        with record_function("mcore.moe.router"):
            logits = self.router.logits(tokens)
            routing = route(logits, self.router_config, self.expert_bias)
        cfg = self.config
        plan_kwargs = dict(align=cfg.align)
        if cfg.capacity_factor is not None:
            plan_kwargs.update(
                capacity_factor=cfg.capacity_factor, drop_policy=cfg.drop_policy, pad_to_capacity=cfg.pad_to_capacity
            )
        out, plan = self.dispatcher(tokens, routing, self.experts, **plan_kwargs)
        out = out.to(x.dtype).view(shape)
        with record_function("mcore.moe.router"):
            counts = tokens_per_expert(routing.indices, cfg.num_experts, padding_mask)
            if self.training and self.expert_bias is not None:
                self.step_tokens_per_expert += counts
            aux = moe_aux_losses(cfg, logits, routing, shape, self.token_split_group, padding_mask)
        self.stats = {"tokens_per_expert": counts, "dropped": plan.dropped, **{k: v.detach() for k, v in aux.items()}}
        coefs = {"aux_loss": cfg.aux_loss_coef, "z_loss": cfg.z_loss_coef}
        weighted = [coefs[name] * value for name, value in aux.items() if value.requires_grad]
        if weighted and self.training:
            out = _AttachAuxLoss.apply(out, sum(weighted), float(self.aux_loss_scale))
        return out


@torch.no_grad()
def update_expert_biases(model_chunks, groups: ProcessGroups | None = None) -> None:
    """Aux-loss-free balancing, once per step: sum each MoE layer's step token counts over tp x cp and dp (every
    rank that routed tokens of this pipeline stage), ``b += rate * sign(mean(c) - c)``, reset the counts.

    Every layer's counts travel in one flat tensor (one all-reduce per group). No-op without biases.
    """
    chunks = [model_chunks] if isinstance(model_chunks, nn.Module) else list(model_chunks)
    layers = [m for c in chunks for m in c.modules() if isinstance(m, MoELayer) and m.expert_bias is not None]
    if not layers:
        return
    groups = groups or ProcessGroups.single()
    flat = torch.cat([m.step_tokens_per_expert for m in layers])
    for group in (groups.tp_cp, groups.dp):
        if group_size(group) > 1:
            dist.all_reduce(flat, group=group)
    start = 0
    for m in layers:
        n = m.config.num_experts
        expert_bias_update(m.expert_bias, flat[start : start + n], m.config.bias_update_rate)
        m.step_tokens_per_expert.zero_()
        start += n


@torch.no_grad()
def moe_metrics(model_chunks) -> dict[str, torch.Tensor] | None:
    """Load statistics of the MoE layers of ``model_chunks`` (this rank's), from each layer's last forward, as 0-d
    device tensors: ``moe_max_load`` (the largest tokens-per-expert over its mean, over layers), ``moe_dropped``
    (choices dropped by capacity, summed over layers), ``moe_aux_loss`` / ``moe_z_loss`` (means over layers, when
    computed). ``None`` without MoE layers. No host sync."""
    chunks = [model_chunks] if isinstance(model_chunks, nn.Module) else list(model_chunks)
    layers = [m for c in chunks for m in c.modules() if isinstance(m, MoELayer) and m.stats]
    if not layers:
        return None
    counts = [m.stats["tokens_per_expert"].float() for m in layers]
    loads = torch.stack([c.max() / c.mean().clamp(min=1e-9) for c in counts])
    out = {"moe_max_load": loads.max(), "moe_dropped": torch.stack([m.stats["dropped"] for m in layers]).sum()}
    for key in ("aux_loss", "z_loss"):
        values = [m.stats[key] for m in layers if key in m.stats]
        if values:
            out[f"moe_{key}"] = torch.stack(values).mean()
    return out
