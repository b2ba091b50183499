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
mask an MoE layer's losses are bit-equal to the unmasked formulas. End to end: mcore-train runs of both models on
packed mock documents at cp 2 (the trainer passes ``padding_mask``) equal the unpadded single process over 3 AdamW
steps (loss and gradient norm within 1e-5, expert biases bit-equal; also with full and MoE-only recompute, and under
dynamic CP), and a given mask under tp 2 with sequence parallelism reaches each rank's slice of the routed tokens.
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


def _sp_mask() -> torch.Tensor:
    return torch.rand(B, 22, generator=torch.Generator().manual_seed(4)) < 0.3


def _mlp_stats(model) -> dict[str, dict[str, torch.Tensor]]:
    layers = _moe_layers(model)
    return {n: {"counts": m.step_tokens_per_expert.clone(), **{k: m.stats[k] for k in ("aux_loss", "z_loss")}}
            for n, m in layers.items()}  # fmt: skip


@functools.cache
def _sp_reference():
    model = _model("mixtral-tiny")
    ids = torch.randint(0, model.config.vocab_size, (B, 22), generator=torch.Generator().manual_seed(6))
    model(ids, labels=ids, padding_mask=_sp_mask()).sum().backward()
    return ids, _mlp_stats(model)


def _check_sequence_parallel(groups) -> dict[str, float]:
    """A given padding mask under tp 2 with sequence parallelism (each tp rank routes its slice of the sequence)."""
    import torch.distributed as dist

    from mcore.models.families import get_config
    from mcore.models.gpt import GPTModel

    model = GPTModel(get_config("mixtral-tiny", **MIXTRAL), groups=groups, sequence_parallel=True)
    model.init_weights(11)
    ids, want = _sp_reference()
    model(ids, labels=ids, padding_mask=_sp_mask()).sum().backward()
    errors = {}
    for name, stats in _mlp_stats(model).items():
        for key in ("counts", "z_loss"):  # each tp rank's share
            dist.all_reduce(stats[key], group=groups.tp)
        errors[f"counts:{name}"] = float((stats["counts"] != want[name]["counts"]).sum())
        for key in ("aux_loss", "z_loss"):
            errors[f"{key}:{name}"] = abs(stats[key].item() - want[name][key].item()) / want[name][key].item()
    return errors


PACKED_RUNS = {  # mcore-train on packed mock documents (padded per document at cp 2), 3 AdamW steps
    "mixtral": ["model=mixtral-tiny", "model.router_aux_loss_coef=0.01",
                "model.moe_router={z_loss_coef: 0.001, expert_bias: true, bias_update_rate: 0.01}"],
    "deepseek_mtp": ["model=deepseek_v3-tiny", "model.num_nextn_predict_layers=1", "model.router_aux_loss_coef=0.01",
                     "model.moe_router={score_function: sigmoid, expert_bias: true, n_group: 4, topk_group: 2, "
                     "routed_scaling_factor: 2.5, bias_update_rate: 0.01, aux_loss_type: sequence}",
                     "train.mtp_loss_weight=0.3"],
}  # fmt: skip
# the mask through recomputed layers (full) and recomputed MoE feed-forwards (selective)
PACKED_RUNS["mixtral_full_recompute"] = [*PACKED_RUNS["mixtral"], "train.recompute=full"]
PACKED_RUNS["mixtral_moe_recompute"] = [*PACKED_RUNS["mixtral"], "train.recompute=selective",
                                        "train.recompute_modules=[moe]"]  # fmt: skip
# dynamic CP (no aux losses there): each document padded to 2 x world, the expert bias without the padding
PACKED_RUNS["mixtral_dynamic_bias"] = ["model=mixtral-tiny", "model.moe_router={expert_bias: true, bias_update_rate: "
                                       "0.01}", "data.seq_length=64"]  # fmt: skip
CP_OVERRIDES = {name: ["parallel.cp=2"] for name in PACKED_RUNS}
CP_OVERRIDES["mixtral_dynamic_bias"] = ["parallel.cp=2", "parallel.cp_dynamic=true"]
PACKED = ["data.mock=true", "data.packing=true"]


def _train(run_dir: str, *overrides: str):
    from tests.train.test_cp_sinks_mtp import STEPS
    from tests.train.test_cp_sinks_mtp import _train as train_capturing

    # 3 steps: the sign updates of these runs' 4th step happen to bring the biases back to 0
    return train_capturing(run_dir, *STEPS, "train.steps=3", *PACKED, *overrides)


def _workers(rank: int, world_size: int, run_root: str):
    from mcore.parallel.cp_groups import build_cp_groups
    from mcore.parallel.grid import ParallelConfig, build_process_groups

    torch.set_num_threads(1)
    groups = build_process_groups(ParallelConfig(cp=2))
    cp_groups = build_cp_groups(groups)
    cases = {family: functools.partial(_check, family, groups, cp_groups) for family in CASES}
    cases["tp2_sp"] = functools.partial(_check_sequence_parallel, build_process_groups(ParallelConfig(tp=2)))
    out = run_cases(cases)
    torch.distributed.barrier()
    for name, overrides in PACKED_RUNS.items():
        out[f"run:{name}"] = _train(f"{run_root}/{name}", *overrides, *CP_OVERRIDES[name])
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(single-process runs, each rank's results) of the packed mcore-train runs and the model cases."""
    root = tmp_path_factory.mktemp("cp_moe_padding")
    singles = {name: _train(str(root / f"single-{name}"), *extra) for name, extra in PACKED_RUNS.items()}
    return singles, run_workers(2, _workers, str(root), timeout=600)


@pytest.fixture(scope="module")
def results(runs):
    return runs[1]


@pytest.mark.parametrize("name", list(PACKED_RUNS))
def test_packed_training_at_cp2_equals_the_single_process(runs, name):
    singles, per_rank = runs
    want_curve, want_biases, _ = singles[name]
    assert len(want_curve) == 3 and any(any(b) for b in want_biases.values())
    for rank, out in enumerate(per_rank):
        curve, biases, cp = out[f"run:{name}"]
        assert cp == 2 and len(curve) == 3, (rank, cp, curve)
        for step, ((loss, norm), (want_loss, want_norm)) in enumerate(zip(curve, want_curve), start=1):
            assert loss == pytest.approx(want_loss, rel=REL, abs=0), (name, rank, step)
            assert norm == pytest.approx(want_norm, rel=REL, abs=0), (name, rank, step)
        assert biases == want_biases, (name, rank)  # the counts of every step without the padding: bit-equal


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


def test_a_padding_mask_under_sequence_parallelism_equals_the_single_process(results):
    for rank, errors in enumerate(case_result(results, "tp2_sp")):
        assert len(errors) == 6, errors  # two MoE layers
        bad = {k: v for k, v in errors.items() if (v != 0 if k.startswith("counts:") else not v < REL)}
        assert not bad, (rank, bad)


# ------------------------------------------------------------------------------------------------ kernels


def _routing(tokens=40, experts=8, k=2, seed=0):
    from mcore.kernels.moe import RouterConfig, route

    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=g, dtype=torch.float64).requires_grad_()
    padding = torch.rand(tokens, generator=g) < 0.3
    return logits, route(logits, RouterConfig(num_experts=experts, topk=k)), padding


def test_masked_counts_and_losses_equal_the_unmasked_ones_on_the_real_tokens():
    from mcore.kernels.moe import load_balancing_loss, tokens_per_expert, z_loss

    logits, routing, padding = _routing()
    real = ~padding
    assert torch.equal(tokens_per_expert(routing.indices, 8, padding), tokens_per_expert(routing.indices[real], 8))
    got = load_balancing_loss(routing.probs, routing.indices, padding_mask=padding)
    want = load_balancing_loss(routing.probs[real], routing.indices[real])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    torch.testing.assert_close(z_loss(logits, padding), z_loss(logits[real]), rtol=1e-12, atol=0)
    (g_got,) = torch.autograd.grad(got + z_loss(logits, padding), logits, retain_graph=True)
    (g_want,) = torch.autograd.grad(want + z_loss(logits[real]), logits)
    torch.testing.assert_close(g_got, g_want, rtol=1e-12, atol=1e-15)
    assert g_got[padding].abs().max() == 0  # padding gets no aux gradient


def test_sequence_wise_loss_averages_each_sequence_over_its_real_tokens():
    from mcore.kernels.moe import load_balancing_loss

    logits, routing, padding = _routing(tokens=40)
    got = load_balancing_loss(routing.probs, routing.indices, sequence_length=10, padding_mask=padding)
    rows = []
    for r in range(4):
        keep = torch.zeros(40, dtype=torch.bool)
        keep[10 * r : 10 * (r + 1)] = True
        keep &= ~padding
        rows.append(load_balancing_loss(routing.probs[keep], routing.indices[keep]))
    torch.testing.assert_close(got, torch.stack(rows).mean(), rtol=1e-12, atol=0)


def test_without_a_mask_the_layer_losses_are_bit_equal_to_the_unmasked_formulas():
    from mcore.kernels.moe import load_balancing_loss, route, tokens_per_expert, z_loss
    from mcore.parallel.expert_parallel import MoEConfig, MoELayer

    cfg = MoEConfig(hidden_size=16, num_experts=4, topk=2, moe_intermediate_size=8, aux_loss_coef=0.01,
                    z_loss_coef=0.001, expert_bias=True)  # fmt: skip
    layer = MoELayer(cfg)
    layer.router.reset_parameters(torch.Generator().manual_seed(1))
    layer.experts.reset_parameters(torch.Generator().manual_seed(2))
    x = torch.randn(6, 3, 16, generator=torch.Generator().manual_seed(3))
    layer(x)
    logits = layer.router.logits(x.reshape(-1, 16))
    routing = route(logits, layer.router_config, layer.expert_bias)
    assert torch.equal(layer.stats["aux_loss"], load_balancing_loss(routing.probs, routing.indices))
    assert torch.equal(layer.stats["z_loss"], z_loss(logits))
    assert torch.equal(layer.stats["tokens_per_expert"], tokens_per_expert(routing.indices, 4))
    with pytest.raises(ValueError, match=r"padding_mask must be a bool tensor \(6, 3\)"):
        layer(x, torch.zeros(3, 6, dtype=torch.bool))
    with pytest.raises(TypeError, match="padding_mask must be a bool tensor"):
        layer(x, torch.zeros(6, 3))


def test_cp_shard_flags_exactly_the_padding():
    from mcore.train.context_parallel import CPBatches

    batch = _batch(1000)
    shards = [CPBatches(2, r, groups=None, granule=4).shard(batch) for r in range(2)]
    sharding = shards[0]["context_parallel"].sharding
    mask = sharding.unshard([s["padding_mask"] for s in shards])
    tokens = sharding.unshard([s["tokens"] for s in shards])
    assert mask.dtype == torch.bool and int((~mask).sum()) == B * S
    for row, start, length in sharding.documents():
        flags = mask[row, start : start + length]
        real = int((~flags).sum())
        assert not flags[:real].any() and flags[real:].all()  # the document first, then its padding
    real_tokens = [tokens[row][~mask[row]] for row in range(B)]
    assert all(torch.equal(real_tokens[row], batch["tokens"][row]) for row in range(B))
    unpacked = {k: batch[k][:, :20] for k in ("tokens", "labels", "loss_mask")}  # plain rows: no padding added
    assert "padding_mask" not in CPBatches(2, 0, groups=None, granule=4).shard(unpacked)
