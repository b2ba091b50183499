"""Multi-token prediction (DeepSeek-V3): the MTP loss and its gradients against a reference written here from HF's
DeepSeek-V3 modules (its decoder layers run the main model and each MTP depth; the MTP combination, token shifts and
document masking are spelled out position by position), for plain rows and packed documents; generation ignores the
modules; the loss weight and the accounting."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from mcore.models.accounting import parameter_counts
from mcore.models.families import get_config
from mcore.models.generate import generate
from mcore.models.gpt import GPTModel
from mcore.parallel.param_attrs import persistent_buffers
from tests.helpers.hf_adapters import deepseek_to_mcore_state
from tests.models.hf_weights import hf_model

DEPTH = 2
B, S = 2, 16


def _config(**overrides):
    return get_config("deepseek_v3-tiny", num_nextn_predict_layers=DEPTH, **overrides)


def _pair(config, seed=0):
    """Our model with MTP and an HF model of ``L + D`` layers whose last ``D`` are the MTP depths' layers (as the
    checkpoints store them), plus the MTP-only weights (norms, eh_proj) drawn here."""
    L = config.num_hidden_layers
    big = dataclasses.replace(config, num_hidden_layers=L + DEPTH, num_nextn_predict_layers=0)
    hf = hf_model(big, seed)
    torch.manual_seed(seed + 7)
    h = config.hidden_size
    extra = []
    for _ in range(DEPTH):
        norms = [torch.rand(h) + 0.5 for _ in range(3)]  # enorm, hnorm, final norm
        extra.append(
            {"enorm": norms[0], "hnorm": norms[1], "final_norm": norms[2], "eh_proj": torch.randn(h, 2 * h) * 0.05}
        )
    state = deepseek_to_mcore_state({k: v.detach() for k, v in hf.state_dict().items()}, big)
    for k in range(DEPTH):
        prefix = f"layers.{L + k}."
        for name in [n for n in state if n.startswith(prefix)]:
            state[f"mtp.layers.{k}.layer." + name[len(prefix) :]] = state.pop(name)
        for name in ("enorm", "hnorm", "final_norm"):
            state[f"mtp.layers.{k}.{name}.weight"] = extra[k][name]
        state[f"mtp.layers.{k}.eh_proj.weight"] = extra[k]["eh_proj"]
    ours = GPTModel(config)
    ours.init_weights(seed + 1)
    targets = dict(ours.named_parameters()) | dict(persistent_buffers(ours))
    assert set(targets) == set(state), (sorted(set(targets) - set(state)), sorted(set(state) - set(targets)))
    with torch.no_grad():
        for name, t in targets.items():
            if t.shape[0] != state[name].shape[0]:  # padded vocabulary rows
                t.zero_()
                t[: state[name].shape[0]].copy_(state[name])
            else:
                t.copy_(state[name])
    return hf, ours, extra


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _documents(cu_seqlens):
    """Per row, each position's document index (the row's index when not packed)."""
    if cu_seqlens is None:
        return [[b] * S for b in range(B)]
    bounds = cu_seqlens.tolist()
    flat = [next(d for d in range(len(bounds) - 1) if bounds[d] <= t < bounds[d + 1]) for t in range(B * S)]
    return [flat[b * S : (b + 1) * S] for b in range(B)]


def _reference(hf, extra, config, ids, labels, cu_seqlens, weight):
    """(LM loss mean, MTP loss) from HF's modules, shifts and masks written out per position."""
    L, eps = config.num_hidden_layers, config.rms_norm_eps
    docs = _documents(cu_seqlens)
    positions = torch.tensor(
        [[sum(1 for j in range(i) if docs[b][j] == docs[b][i]) for i in range(S)] for b in range(B)]
    )
    allowed = torch.tensor(
        [[[docs[b][j] == docs[b][i] and j <= i for j in range(S)] for i in range(S)] for b in range(B)]
    )
    mask = torch.zeros(B, 1, S, S).masked_fill(~allowed[:, None], torch.finfo(torch.float32).min)
    x = hf.model.embed_tokens(ids)
    rope = hf.model.rotary_emb(x, positions)
    for layer in hf.model.layers[:L]:
        x = layer(x, attention_mask=mask, position_ids=positions, position_embeddings=rope)
    lm = F.cross_entropy(hf.lm_head(hf.model.norm(x)).flatten(0, 1), labels.flatten(), ignore_index=-100)
    total = 0.0
    h = x
    for k in range(1, DEPTH + 1):
        tokens = torch.zeros_like(ids)
        targets = torch.full_like(labels, -100)
        for b in range(B):
            for i in range(S):
                if i + k < S and docs[b][i + k] == docs[b][i]:
                    tokens[b, i], targets[b, i] = ids[b, i + k], labels[b, i + k]
        e = extra[k - 1]
        mixed = torch.cat([_rms(hf.model.embed_tokens(tokens), e["enorm"], eps), _rms(h, e["hnorm"], eps)], dim=-1)
        h = hf.model.layers[L + k - 1](
            mixed @ e["eh_proj"].t(), attention_mask=mask, position_ids=positions, position_embeddings=rope
        )
        logits = hf.lm_head(_rms(h, e["final_norm"], eps))
        total = total + F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    return lm, total * weight / DEPTH


@pytest.mark.parametrize("packed", [False, True])
def test_mtp_loss_and_grads_equal_the_reference(packed):
    config = _config()
    hf, ours, extra = _pair(config)
    ours.mtp_loss_weight = 0.3
    ids = torch.randint(0, config.vocab_size, (B, S))
    labels = torch.randint(0, config.vocab_size, (B, S))
    labels[torch.rand(B, S) < 0.15] = -100
    cu = torch.tensor([0, 5, 16, 23, 32], dtype=torch.int32) if packed else None
    for p in extra[0].values():
        p.requires_grad_(True)
    ref_lm, ref_mtp = _reference(hf, extra, config, ids, labels, cu, 0.3)

    out = ours(ids, labels=labels, cu_seqlens=cu)
    valid = labels != -100
    lm = out[valid].sum() / valid.sum()
    torch.testing.assert_close(lm, ref_lm, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.mtp.stats["mtp_loss"], ref_mtp.detach(), rtol=1e-5, atol=1e-6)
    assert ref_mtp.item() > 0.1  # both depths predict something

    (ref_lm + ref_mtp).backward()
    lm.backward()  # the MTP loss joins through the returned loss's graph (aux_loss_scale 1)
    grads = {
        "embedding.weight": hf.model.embed_tokens.weight.grad,
        "mtp.layers.0.eh_proj.weight": extra[0]["eh_proj"].grad,
        "mtp.layers.0.enorm.weight": extra[0]["enorm"].grad,
        "mtp.layers.1.layer.attention.kv_up.weight": hf.model.layers[
            config.num_hidden_layers + 1
        ].self_attn.kv_b_proj.weight.grad,
        "layers.2.attention.kv_down.weight": hf.model.layers[2].self_attn.kv_a_proj_with_mqa.weight.grad,
    }
    params = dict(ours.named_parameters())
    for name, want in grads.items():
        got = params[name].grad[: want.shape[0]]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6 * max(1.0, want.abs().max().item()), msg=name)


def test_packing_masks_cross_document_predictions():
    """Guard: the same rows without document boundaries give another MTP loss (the masks are not vacuous)."""
    config = _config()
    _, ours, _ = _pair(config)
    ids = torch.randint(0, config.vocab_size, (B, S))
    labels = torch.randint(0, config.vocab_size, (B, S))
    with torch.no_grad():
        ours(ids, labels=labels)
        plain = ours.mtp.stats["mtp_loss"]
        ours(ids, labels=labels, cu_seqlens=torch.tensor([0, 5, 16, 23, 32], dtype=torch.int32))
        packed = ours.mtp.stats["mtp_loss"]
    assert (plain - packed).abs() > 1e-4


def test_generation_and_logits_ignore_the_mtp_modules():
    config = _config()
    _, ours, _ = _pair(config)
    plain = GPTModel(dataclasses.replace(config, num_nextn_predict_layers=0))
    plain.load_state_dict({k: v for k, v in ours.state_dict().items() if not k.startswith("mtp.")})
    ids = torch.randint(0, config.vocab_size, (B, 6))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), plain(ids), rtol=0, atol=0)
    assert torch.equal(generate(ours, ids, 5), generate(plain, ids, 5))


def test_mtp_parameters_are_counted():
    config = _config()
    ours = GPTModel(config, device="meta")
    counts = parameter_counts(config)
    assert counts.mtp == sum(p.numel() for n, p in ours.named_parameters() if n.startswith("mtp."))
    vocab_tensors = counts.embedding + counts.output
    assert counts.total - vocab_tensors == sum(
        p.numel()
        for n, p in ours.named_parameters()
        if "vocab" not in n and n not in ("embedding.weight", "output.weight")
    )
