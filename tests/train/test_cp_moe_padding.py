"""Context parallelism's per-document padding out of the MoE routing statistics (issue #18 / #16).

Packed documents are padded to a multiple of 2 x cp (``CPBatches.shard``), and the batch carries ``padding_mask``;
MoE layers leave those tokens out of the tokens per expert (so of the aux-loss-free bias update), of the
load-balancing loss (micro-batch and sequence-wise) and of the z-loss, normalised by the real tokens over the ranks
that split them. Checked on one 2-rank gloo spawn: Mixtral tiny (global aux loss, z-loss, expert bias) and
DeepSeek-V3 tiny (sigmoid, grouped routing, sequence-wise aux loss, expert bias, one MTP depth) at cp 2 on documents
whose lengths need padding, against the same unpadded documents in one process (fp32): loss, every gradient (summed
over the CP group, as the dp x cp reduction does), every MoE layer's aux / z loss and tokens per expert, and the
expert biases after one update (bit-equal). Without the mask the counts would include the padding (checked, so the
comparison can fail). The kernels' masked statistics equal the unmasked ones on the real tokens alone, and without a
mask an MoE layer's losses are bit-equal to the unmasked formulas.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.helpers.distributed import run_workers
from tests.parallel._helpers import case_result, run_cases

REL = 1e-5
B, S = 2, 21
# document lengths per row: none a multiple of 4 (= 2 x cp), so every document gets padding
LENGTHS = ((5, 9, 7), (3, 11, 7))
MIXTRAL = dict(router_aux_loss_coef=0.01, moe_router={"z_loss_coef": 0.001, "expert_bias": True,
                                                      "bias_update_rate": 0.01})  # fmt: skip
DEEPSEEK = dict(
    router_aux_loss_coef=0.01,
    num_nextn_predict_layers=1,
    moe_router={"score_function": "sigmoid", "expert_bias": True, "n_group": 4, "topk_group": 2,
                "routed_scaling_factor": 2.5, "bias_update_rate": 0.01, "aux_loss_type": "sequence"},
)  # fmt: skip
CASES = {"mixtral-tiny": MIXTRAL, "deepseek_v3-tiny": DEEPSEEK}


def _batch(vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (B, S), generator=g)
    labels = torch.randint(0, vocab, (B, S), generator=g)
    labels[torch.rand(B, S, generator=g) < 0.2] = -100
    bounds = [0]
    for row in LENGTHS:
        for n in row:
            bounds.append(bounds[-1] + n)
    assert bounds[-1] == B * S
    cu = torch.tensor(bounds, dtype=torch.int32)
    return {"tokens": ids, "labels": labels, "loss_mask": (labels != -100).float(), "cu_seqlens": cu}


def _model(family: str, groups=None):
    from mcore.models.families import get_config
    from mcore.models.gpt import GPTModel

    model = GPTModel(get_config(family, **CASES[family]), groups=groups)
    model.init_weights(11)
    model.mtp_loss_weight = 0.3
    return model


def _moe_layers(model):
    from mcore.parallel.expert_parallel import MoELayer

    return {name: m for name, m in model.named_modules() if isinstance(m, MoELayer)}


def _results(model, loss) -> dict:
    from mcore.parallel.expert_parallel import update_expert_biases

    layers = _moe_layers(model)
    out = {
        "loss": loss.detach(),
        "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
        "counts": {n: m.step_tokens_per_expert.clone() for n, m in layers.items()},
        "aux": {n: m.stats["aux_loss"] for n, m in layers.items()},
        "z": {n: m.stats["z_loss"] for n, m in layers.items() if "z_loss" in m.stats},
    }
    return out, layers, update_expert_biases


@functools.cache
def _single_process(family: str):
    model = _model(family)
    batch = _batch(model.config.vocab_size)
    out = model(batch["tokens"], labels=batch["labels"], cu_seqlens=batch["cu_seqlens"])
    loss = out.sum() / batch["loss_mask"].sum()
    loss.backward()
    results, layers, update = _results(model, loss)
    update(model)
    results["biases"] = {n: m.expert_bias.clone() for n, m in layers.items()}
    return results


def _check(family: str, groups, cp_groups) -> dict[str, float]:
    from mcore.train.context_parallel import CPBatches

    model = _model(family, groups)
    batch = _batch(model.config.vocab_size)
    shard = CPBatches(2, groups.cp_rank, cp_groups, "p2p", granule=4).shard(batch)
    context, mask = shard["context_parallel"], shard["padding_mask"]
    out = model(shard["tokens"], labels=shard["labels"], context_parallel=context, padding_mask=mask)
    loss = (out * shard["loss_mask"]).sum() / shard["loss_tokens"]  # this rank's share of the micro-batch mean
    loss.backward()
    got, layers, update = _results(model, loss)
    want = _single_process(family)
    errors = {"loss": abs(context.sum(got["loss"]).item() - want["loss"].item()) / want["loss"].item()}
    errors["padding"] = float(mask.sum())  # tokens the mask leaves out on this rank
    for name, grad in want["grads"].items():
        summed = context.sum(got["grads"].get(name, torch.zeros_like(grad)))
        errors[f"grad:{name}"] = (summed - grad).norm().item() / max(grad.norm().item(), 1e-30)
    for name in want["counts"]:
        errors[f"counts:{name}"] = float((context.sum(got["counts"][name]) != want["counts"][name]).sum())
        errors[f"aux:{name}"] = abs(got["aux"][name].item() - want["aux"][name].item()) / want["aux"][name].item()
        if name in want["z"]:
            z = context.sum(got["z"][name]).item()  # each rank's share of the micro-batch's mean
            errors[f"z:{name}"] = abs(z - want["z"][name].item()) / want["z"][name].item()
    update(model, groups)
    for name, layer in layers.items():
        errors[f"bias:{name}"] = float((layer.expert_bias != want["biases"][name]).sum())
    errors["moved"] = float(sum(b.abs().sum() for b in want["biases"].values()) > 0)
    # the control: the choices the padding would have added to the counts without the mask
    routed = context.sum(torch.tensor(shard["tokens"].numel())).item() * model.config.num_experts_per_tok
    errors["counted_without_mask"] = routed * len(layers) - sum(int(c.sum()) for c in want["counts"].values())
    return errors


def _workers(rank: int, world_size: int):
    from mcore.parallel.cp_groups import build_cp_groups
    from mcore.parallel.grid import ParallelConfig, build_process_groups

    torch.set_num_threads(1)
    groups = build_process_groups(ParallelConfig(cp=2))
    cp_groups = build_cp_groups(groups)
    return run_cases({family: functools.partial(_check, family, groups, cp_groups) for family in CASES})


@pytest.fixture(scope="module")
def results():
    return run_workers(2, _workers, timeout=600)


@pytest.mark.parametrize("family", list(CASES))
def test_padded_cp_run_equals_the_unpadded_single_process(results, family):
    for rank, errors in enumerate(case_result(results, family)):
        assert errors["padding"] > 0 and errors["moved"] == 1.0, (rank, errors["padding"])
        assert errors["counted_without_mask"] > 0  # the padding's choices, which the mask keeps out
        assert any(key.startswith("counts:") for key in errors) and any(key.startswith("bias:") for key in errors)
        if family.startswith("mixtral"):
            assert any(key.startswith("z:") for key in errors)
        else:
            assert any(key.startswith("grad:mtp.") for key in errors)
        exact = {k: v for k, v in errors.items() if k.startswith(("counts:", "bias:")) and v != 0}
        assert not exact, (rank, exact)
        close = {k: v for k, v in errors.items() if k.startswith(("loss", "grad:", "aux:", "z:")) and not v < REL}
        assert not close, (rank, close)
