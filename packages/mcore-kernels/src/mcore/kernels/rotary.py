"""Rotary position embeddings (RoPE) in the rotate-half convention shared by Hugging Face and Megatron.

Three steps: :func:`rope_inv_freq` turns a model's ``head_dim``/``rope_theta``/``rope_scaling`` into the
inverse frequencies (and the attention factor that scales cos/sin), equal to what Hugging Face
``transformers`` computes for the same config; :func:`rope_cos_sin` turns them and the position ids into
cos/sin tables; :func:`apply_rotary` rotates q and k with those tables (Triton on CUDA, a torch reference
elsewhere), as one ``torch.autograd.Function`` whose backward is the inverse rotation.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import torch

from mcore.kernels import dispatch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Keys accepted in ``rope_scaling`` for every type besides the ones each type reads.
_COMMON_KEYS = frozenset({"rope_type", "type", "rope_theta", "partial_rotary_factor"})
_TYPE_KEYS = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "llama3": frozenset({"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}),
    "yarn": frozenset(
        {
            "factor",
            "original_max_position_embeddings",
            "attention_factor",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
            "truncate",
        }
    ),
}


def rope_inv_freq(
    head_dim: int,
    rope_theta: float,
    rope_scaling: Mapping[str, Any] | None = None,
    max_position_embeddings: int | None = None,
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``fp32 [head_dim // 2]`` and the attention factor for a RoPE configuration.

    ``rope_scaling`` is a Hugging Face ``rope_scaling`` / ``rope_parameters`` dict (or ``None`` for plain
    RoPE); its type is read from ``rope_type`` or the older ``type`` key. Supported types:
    ``default``, ``linear``, ``llama3`` and ``yarn``. ``llama3`` and ``yarn`` take
    ``original_max_position_embeddings`` from the dict, else from ``max_position_embeddings``; ``yarn``
    without a ``factor`` uses ``max_position_embeddings / original_max_position_embeddings``. The values
    are computed in fp32 in the same order of operations as ``transformers`` so that the tables match
    bit for bit on the same device. The attention factor multiplies cos and sin (1.0 except for yarn).
    """
    if isinstance(head_dim, bool) or not isinstance(head_dim, numbers.Integral) or head_dim <= 0 or head_dim % 2:
        raise ValueError(f"rope_inv_freq: head_dim must be a positive even integer, got {head_dim!r}")
    theta = _positive("rope_theta", rope_theta)
    params = dict(rope_scaling or {})
    rope_type = _rope_type(params)
    if "rope_theta" in params and float(params["rope_theta"]) != theta:
        raise ValueError(
            f"rope_inv_freq: rope_scaling['rope_theta']={params['rope_theta']!r} disagrees with "
            f"rope_theta={rope_theta!r}; pass one value"
        )
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(
            f"rope_inv_freq: partial rotary embeddings are not supported, got "
            f"partial_rotary_factor={params['partial_rotary_factor']!r} (expected 1.0)"
        )
    unknown = set(params) - _COMMON_KEYS - _TYPE_KEYS[rope_type]
    if unknown:
        raise ValueError(
            f"rope_inv_freq: unknown keys {sorted(unknown)} in rope_scaling for rope_type {rope_type!r}; "
            f"expected a subset of {sorted(_COMMON_KEYS | _TYPE_KEYS[rope_type])}"
        )
    if rope_type == "default":
        return _base_inv_freq(head_dim, theta), 1.0
    if rope_type == "linear":
        return _base_inv_freq(head_dim, theta) / _positive("factor", _required(params, "factor", rope_type)), 1.0
    original = params.get("original_max_position_embeddings", max_position_embeddings)
    if original is None:
        raise ValueError(
            f"rope_inv_freq: rope_type {rope_type!r} needs original_max_position_embeddings in rope_scaling "
            f"or the max_position_embeddings argument; got neither"
        )
    original = _positive("original_max_position_embeddings", original)
    if rope_type == "llama3":
        return _llama3_inv_freq(head_dim, theta, params, original), 1.0
    return _yarn_inv_freq(head_dim, theta, params, original, max_position_embeddings)


def _rope_type(params: dict[str, Any]) -> str:
    rope_type, legacy = params.get("rope_type"), params.get("type")
    if rope_type is not None and legacy is not None and rope_type != legacy:
        raise ValueError(f"rope_inv_freq: rope_scaling has rope_type={rope_type!r} but type={legacy!r}; use one")
    rope_type = rope_type or legacy or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_inv_freq: unsupported rope_type {rope_type!r}; supported types are {list(SUPPORTED_ROPE_TYPES)}"
        )
    return rope_type


def _required(params: dict[str, Any], key: str, rope_type: str) -> Any:
    if params.get(key) is None:
        raise ValueError(f"rope_inv_freq: rope_type {rope_type!r} needs rope_scaling[{key!r}], got {params}")
    return params[key]


def _positive(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
        raise ValueError(f"rope_inv_freq: {name} must be a positive number, got {value!r}")
    return float(value)


def _base_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    return 1.0 / (theta**exponents)


def _llama3_inv_freq(head_dim: int, theta: float, params: dict[str, Any], original: float) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by ``factor``, interpolate smoothly in between."""
    factor = _positive("factor", _required(params, "factor", "llama3"))
    low = _positive("low_freq_factor", _required(params, "low_freq_factor", "llama3"))
    high = _positive("high_freq_factor", _required(params, "high_freq_factor", "llama3"))
    if not high > low:
        raise ValueError(f"rope_inv_freq: llama3 needs high_freq_factor > low_freq_factor, got {high} <= {low}")
    inv_freq = _base_inv_freq(head_dim, theta)
    wavelength = 2 * math.pi / inv_freq
    # Wavelengths longer than original/low are slowed down by `factor`; shorter than original/high are kept.
    scaled = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelength - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_between = ~(wavelength < original / high) * ~(wavelength > original / low)
    return torch.where(in_between, blended, scaled)


def _yarn_inv_freq(
    head_dim: int, theta: float, params: dict[str, Any], original: float, max_position_embeddings: int | None
) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv:2309.00071): interpolate low frequencies, extrapolate high ones, ramp in between."""
    factor = params.get("factor")
    if factor is None:
        if max_position_embeddings is None:
            raise ValueError("rope_inv_freq: yarn without rope_scaling['factor'] needs max_position_embeddings")
        factor = max_position_embeddings / original
    factor = _positive("factor", factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        # The dim index whose wavelength fits `rotations` full turns into the original context.
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # the ramp below divides by high - low
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).to(torch.float32) / head_dim)
    extrapolated = 1.0 / pos_freqs
    interpolated = 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    inv_freq = interpolated * (1 - extrapolation_weight) + extrapolated * extrapolation_weight
    return inv_freq, float(attention_factor)


def rope_cos_sin(
    inv_freq: torch.Tensor,
    position_ids: torch.Tensor,
    attention_factor: float = 1.0,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape ``position_ids.shape + (head_dim,)`` in rotate-half layout.

    The angles ``position * inv_freq`` are computed in fp32 and laid out as ``cat(freqs, freqs)``;
    cos and sin are multiplied by ``attention_factor`` and then cast to ``dtype``.
    """
    if not isinstance(inv_freq, torch.Tensor) or inv_freq.dim() != 1 or not inv_freq.is_floating_point():
        got = (
            f"{inv_freq.dtype} tensor of shape {tuple(inv_freq.shape)}"
            if isinstance(inv_freq, torch.Tensor)
            else type(inv_freq).__name__
        )
        raise TypeError(f"rope_cos_sin: inv_freq must be a 1-D floating tensor [head_dim // 2], got {got}")
    if not isinstance(position_ids, torch.Tensor) or position_ids.is_floating_point() or position_ids.is_complex():
        got = position_ids.dtype if isinstance(position_ids, torch.Tensor) else type(position_ids).__name__
        raise TypeError(f"rope_cos_sin: position_ids must be an integer tensor, got {got}")
    if inv_freq.device != position_ids.device:
        raise ValueError(
            f"rope_cos_sin: inv_freq is on {inv_freq.device} but position_ids on {position_ids.device}; "
            "move both to one device"
        )
    if dtype not in _FLOAT_DTYPES:
        raise TypeError(f"rope_cos_sin: dtype must be float16, bfloat16 or float32, got {dtype}")
    freqs = position_ids.unsqueeze(-1).to(torch.float32) * inv_freq.to(torch.float32)
    angles = torch.cat((freqs, freqs), dim=-1)
    return (angles.cos() * attention_factor).to(dtype), (angles.sin() * attention_factor).to(dtype)


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k by the rotary tables: ``x * cos + rotate_half(x) * sin`` for each head.

    Args:
        q: ``[..., Hq, D]`` and k: ``[..., Hk, D]`` with the same leading dims (``Hq`` may differ from
            ``Hk``: grouped-query attention); fp16/bf16/fp32; ``D`` even. Any strides.
        cos, sin: same shape, broadcastable to ``q.shape[:-2] + (D,)`` (e.g. ``[s, 1, D]`` for ``[s, b, H, D]``
            inputs, ``[b, s, D]`` for ``[b, s, H, D]``); fp16/bf16/fp32. They are constants here: no
            gradient flows to them, so they must not require grad.
        backend: ``"triton"`` or ``"reference"``; ``None`` lets :func:`mcore.kernels.dispatch.choose` decide.

    Returns:
        ``(q_out, k_out)``, shaped and typed like ``q`` and ``k``; math is done in fp32.
    """
    _check_rotary_inputs(q, k, cos, sin)
    chosen = dispatch.choose("apply_rotary", q, k, cos, sin, backend=backend)
    return _RotaryFunction.apply(q, k, cos, sin, chosen)


def _check_rotary_inputs(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    named = {"q": q, "k": k, "cos": cos, "sin": sin}
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"apply_rotary: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"apply_rotary: {name} must be float16, bfloat16 or float32, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"apply_rotary: {name} is on {t.device} but q is on {q.device}; move all to one device")
    for name in ("q", "k"):
        if named[name].dim() < 2:
            raise ValueError(
                f"apply_rotary: {name} must be [..., heads, head_dim], got shape {tuple(named[name].shape)}"
            )
    head_dim = q.shape[-1]
    if head_dim == 0 or head_dim % 2:
        raise ValueError(f"apply_rotary: head_dim (last dim of q) must be a positive even number, got {head_dim}")
    if k.shape[-1] != head_dim or k.shape[:-2] != q.shape[:-2]:
        raise ValueError(
            f"apply_rotary: k must be [..., Hk, {head_dim}] with the leading dims of q {tuple(q.shape[:-2])}, "
            f"got k {tuple(k.shape)} for q {tuple(q.shape)}"
        )
    if cos.shape != sin.shape:
        raise ValueError(
            f"apply_rotary: cos and sin must have one shape, got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    target = tuple(q.shape[:-2]) + (head_dim,)
    try:
        broadcast = tuple(torch.broadcast_shapes(cos.shape, target))
    except RuntimeError:
        broadcast = None
    if broadcast != target:
        raise ValueError(
            f"apply_rotary: cos/sin of shape {tuple(cos.shape)} do not broadcast to q.shape[:-2] + (head_dim,) "
            f"= {target} (q is {tuple(q.shape)})"
        )
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        raise ValueError(
            "apply_rotary: cos/sin require grad, but no gradient is computed for them; pass detached tables"
        )


def reference_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch rotation of q and k (fp32 math); ``backward=True`` applies the transposed rotation.

    With halves ``x = [x1, x2]``, ``cos = [c1, c2]``, ``sin = [s1, s2]``: forward
    ``[x1*c1 - x2*s1, x2*c2 + x1*s2]``; its transpose ``[g1*c1 + g2*s2, g2*c2 - g1*s1]``.
    """
    c1, c2 = cos.float().unsqueeze(-2).chunk(2, dim=-1)
    s1, s2 = sin.float().unsqueeze(-2).chunk(2, dim=-1)
    if backward:
        s1, s2 = -s2, -s1

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * c1 - x2 * s1, x2 * c2 + x1 * s2), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


def _backend_impl(backend: str):
    if backend == dispatch.TRITON:
        from mcore.kernels.triton.rotary import rotary

        return rotary
    return reference_rotary


class _RotaryFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin, backend):
        q_out, k_out = _backend_impl(backend)(q, k, cos, sin, False)
        ctx.save_for_backward(cos, sin)
        ctx.backend = backend
        return q_out, k_out

    @staticmethod
    def backward(ctx, dq_out, dk_out):
        cos, sin = ctx.saved_tensors
        dq, dk = _backend_impl(ctx.backend)(dq_out, dk_out, cos, sin, True)
        return dq, dk, None, None, None
