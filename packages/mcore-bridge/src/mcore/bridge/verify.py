"""``mcore-bridge verify``: run the Hugging Face model and the mcore model on the same tokens and compare.

Both run in float32 (weights upcast exactly) with HF's eager attention as the reference. Reported: the largest
absolute logit difference, the mean KL divergence KL(HF || mcore) per token, top-1 agreement, and the per-layer
difference of the hidden states with the first layer that exceeds the tolerance. A comparison passes when the
logits and every layer are within ``rtol`` of the reference's magnitude and the mean KL is at most ``max_kl``.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

import torch

from mcore.bridge.config_translation import hf_to_mcore
from mcore.bridge.errors import BridgeError
from mcore.bridge.hf import CONFIG_FILE, read_config
from mcore.bridge.mappings import family_for_hf_config
from mcore.bridge.sources import resolve_source
from mcore.train.checkpoint import CheckpointError, CheckpointReader, load_model

DEFAULT_RTOL = 1e-4
DEFAULT_MAX_KL = 1e-6


@dataclass
class VerifyReport:
    family: str
    tokens: int
    device: str
    max_abs_logit_diff: float
    logit_scale: float  # max |HF logit|
    mean_kl: float
    top1_agreement: float
    layer_max_abs_diff: list[float]
    layer_scale: list[float]  # max |HF hidden state| per layer
    rtol: float
    max_kl: float

    def _tolerance(self, scale: float) -> float:
        return self.rtol * max(scale, 1.0)

    @property
    def first_divergent_layer(self) -> int | None:
        for i, (diff, scale) in enumerate(zip(self.layer_max_abs_diff, self.layer_scale)):
            if not diff <= self._tolerance(scale):  # NaN diverges too
                return i
        return None

    @property
    def logits_ok(self) -> bool:
        return self.max_abs_logit_diff <= self._tolerance(self.logit_scale) and self.mean_kl <= self.max_kl

    @property
    def passed(self) -> bool:
        return self.logits_ok and self.first_divergent_layer is None

    def to_dict(self) -> dict:
        out = asdict(self)
        out["first_divergent_layer"] = self.first_divergent_layer
        out["passed"] = self.passed
        return out

    def format(self) -> str:
        layer = self.first_divergent_layer
        lines = [
            f"family:                {self.family}, {self.tokens} random tokens on {self.device} (float32)",
            f"max |logit diff|:      {self.max_abs_logit_diff:.3e} (tolerance "
            f"{self._tolerance(self.logit_scale):.3e}, max |logit| {self.logit_scale:.3g})",
            f"mean KL(hf || mcore):  {self.mean_kl:.3e} (tolerance {self.max_kl:.1e})",
            f"top-1 agreement:       {self.top1_agreement:.4f}",
        ]
        if layer is None:
            worst = max(self.layer_max_abs_diff, default=0.0)
            lines.append(
                f"hidden states:         all {len(self.layer_max_abs_diff)} layers agree (max diff {worst:.3e})"
            )
        else:
            lines.append(
                f"first divergent layer: {layer} (max diff {self.layer_max_abs_diff[layer]:.3e}, "
                f"tolerance {self._tolerance(self.layer_scale[layer]):.3e})"
            )
        lines.append("PASS" if self.passed else "FAIL")
        return "\n".join(lines)


def _capture(layers: list[torch.nn.Module], seq_first: bool) -> tuple[list[torch.Tensor], list]:
    outputs: list[torch.Tensor] = []

    def hook(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        outputs.append((hidden.transpose(0, 1) if seq_first else hidden).detach().float())

    return outputs, [layer.register_forward_hook(hook) for layer in layers]


def verify(
    hf_path: str | os.PathLike,
    mcore_path: str | os.PathLike,
    *,
    tokens: int = 64,
    device: str = "cpu",
    seed: int = 0,
    rtol: float = DEFAULT_RTOL,
    max_kl: float = DEFAULT_MAX_KL,
) -> VerifyReport:
    """Compare the HF model at ``hf_path`` (directory or hub id) with the mcore checkpoint at ``mcore_path``."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise BridgeError(
            "verify runs the Hugging Face model and needs transformers: pip install 'mcore-bridge[verify]' "
            "(or pip install transformers)"
        ) from None
    if tokens < 1:
        raise BridgeError(f"--tokens must be >= 1, got {tokens}")
    if device not in ("cpu", "cuda"):
        raise BridgeError(f"--device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise BridgeError("--device cuda: no CUDA device is available; use --device cpu")
    hf_source, mcore_source = resolve_source(hf_path), resolve_source(mcore_path)
    if hf_source.kind != "hf" or mcore_source.kind != "mcore":
        raise BridgeError(
            f"verify takes a Hugging Face model then an mcore checkpoint; got {hf_source.kind} {hf_path} and "
            f"{mcore_source.kind} {mcore_path}"
        )
    hf_config = read_config(hf_source.path)
    family = family_for_hf_config(hf_config, str(hf_source.path / CONFIG_FILE))
    dev = torch.device(device)
    try:
        with CheckpointReader(mcore_source.path) as reader:
            config = reader.model_config
            expected = hf_to_mcore(hf_config, family).to_dict()
            differ = [
                k for k, v in config.to_dict().items() if k != "make_vocab_size_divisible_by" and expected[k] != v
            ]
            if differ:
                raise BridgeError(f"{hf_path} and {mcore_path} describe different models (fields {differ} differ)")
            mcore_model = load_model(reader, device=dev)
    except CheckpointError as exc:
        raise BridgeError(str(exc)) from None
    hf_model = AutoModelForCausalLM.from_pretrained(
        hf_source.path, dtype=torch.float32, attn_implementation="eager"
    ).to(dev)
    hf_model.eval()

    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (1, tokens), generator=generator).to(dev)
    hf_hidden, hf_hooks = _capture(list(hf_model.model.layers), seq_first=False)
    mc_hidden, mc_hooks = _capture(list(mcore_model.layers.values()), seq_first=True)
    previous_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # tf32 matmuls would dominate the differences we measure
    try:
        with torch.no_grad():
            ref = hf_model(ids).logits.float()
            ours = mcore_model(ids)[..., : config.vocab_size].float()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous_tf32
        for handle in hf_hooks + mc_hooks:
            handle.remove()

    log_p, log_q = torch.log_softmax(ref.double(), -1), torch.log_softmax(ours.double(), -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean()
    return VerifyReport(
        family=family.name,
        tokens=tokens,
        device=device,
        max_abs_logit_diff=(ref - ours).abs().max().item(),
        logit_scale=ref.abs().max().item(),
        mean_kl=kl.item(),
        top1_agreement=(ref.argmax(-1) == ours.argmax(-1)).float().mean().item(),
        layer_max_abs_diff=[(a - b).abs().max().item() for a, b in zip(hf_hidden, mc_hidden)],
        layer_scale=[a.abs().max().item() for a in hf_hidden],
        rtol=rtol,
        max_kl=max_kl,
    )
