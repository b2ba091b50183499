"""Attention sinks (GPT-OSS), MLA and multi-token prediction (DeepSeek-V3) under context parallelism, on one 4-rank
gloo spawn, against the same model in one process (fp32):

- ``shift_left`` (MTP's ``t[i + k]`` across the 2 x cp pieces and document ends) at cp 2 and 4, k = 1..3 (k longer
  than a piece too), plain rows and packed documents: values, and the gradient of a float input;
- one forward and backward of GPT-OSS tiny (sinks, sliding window 8 < the sequence) and of DeepSeek-V3 tiny (MLA,
  MoE, two MTP depths) for each ``cp_comm_type`` at cp 2 and 4 (a2a+p2p as 2 x 2), plain and packed: the loss, the
  MTP loss and every parameter's gradient (summed over the CP group, as the dp x cp reduction does) within 1e-5;
- mcore-train runs (``run_training``) over 4 AdamW steps: GPT-OSS at cp2 x dp2 (p2p, packed mock documents padded per
  document), cp4 a2a+p2p 2 x 2, cp2 x tp2 with sequence parallelism and cp2 x ep4 (packed); DeepSeek-V3 with MTP at
  cp2 x dp2 (a2a), cp2 x tp2 (SP), cp2 x ep2 and cp2 x pp2 (MTP on the last stage, MLA recomputed by module), with
  the sequence-wise aux loss; Mixtral with the global aux loss and the z-loss at cp4 and cp2 x tp2 (SP): per-step
  loss and gradient norm of the single process within 1e-5, and the MoE runs' expert biases bit-equal (unpacked
  rows; packed rows with the padding mask: ``test_cp_moe_padding.py``); DeepSeek-V3 with
  two MTP depths on packed mock documents (no expert bias, no aux loss) at cp2 x dp2; Mixtral (no aux loss) under
  dynamic CP (``parallel.cp_dynamic``) on 64-token packed rows.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.helpers.distributed import run_workers
from tests.parallel._helpers import case_result, run_cases

REL = 1e-5
B, S = 2, 24
DOCS = (0, 8, 24, 32, 48)  # lengths 8, 16 | 8, 16: multiples of 2 x cp for cp 2 and 4 (pieces of 1 and 2 at cp 4)
MTP_DEPTH = 2
# (family, comm type, cp, packed)
MODEL_CASES = {
    "gpt_oss-p2p-cp2-packed": ("gpt_oss-tiny", "p2p", 2, True),
    "gpt_oss-all_gather-cp2": ("gpt_oss-tiny", "all_gather", 2, False),
    "gpt_oss-a2a-cp2-packed": ("gpt_oss-tiny", "a2a", 2, True),
    "gpt_oss-p2p-cp4-packed": ("gpt_oss-tiny", "p2p", 4, True),
    "gpt_oss-all_gather-cp4-packed": ("gpt_oss-tiny", "all_gather", 4, True),
    "gpt_oss-a2a+p2p-cp4-packed": ("gpt_oss-tiny", "a2a+p2p", 4, True),
    "deepseek_v3-p2p-cp2-packed": ("deepseek_v3-tiny", "p2p", 2, True),
    "deepseek_v3-a2a-cp2": ("deepseek_v3-tiny", "a2a", 2, False),
    "deepseek_v3-all_gather-cp4-packed": ("deepseek_v3-tiny", "all_gather", 4, True),
    "deepseek_v3-a2a-cp4-packed": ("deepseek_v3-tiny", "a2a", 4, True),
    "deepseek_v3-a2a+p2p-cp4-packed": ("deepseek_v3-tiny", "a2a+p2p", 4, True),
}
SHIFT_CASES = [(cp, k, packed) for cp in (2, 4) for k in (1, 2, 3) for packed in (False, True)]

# ------------------------------------------------------------------------------------------------ shift


def _shift_reference(x: torch.Tensor, k: int, bounds, fill) -> torch.Tensor:
    """``y[i] = x[i + k]`` inside each document of the full ``[B, S, ...]`` tensor, spelled out token by token."""
    flat, out = x.flatten(0, 1), torch.full_like(x.flatten(0, 1), fill)
    bounds = list(range(0, B * S + 1, S)) if bounds is None else list(bounds)
    for lo, hi in zip(bounds, bounds[1:]):
        for t in range(lo, hi - k):
            out[t] = flat[t + k]
    return out.view(x.shape)


def _check_shift(cp: int, k: int, packed: bool, group) -> dict[str, float]:
    import torch.distributed as dist

    from mcore.parallel.context_parallel import CPSharding
    from mcore.parallel.cp_shift import shift_left

    bounds = DOCS if packed else None
    sharding, rank = CPSharding(B, S, cp, bounds), dist.get_rank(group)
    g = torch.Generator().manual_seed(10 * k + cp)
    ids = torch.randint(1, 1000, (B, S), generator=g)
    x, dy = torch.randn(B, S, 3, generator=g), torch.randn(B, S, 3, generator=g)
    got_ids = shift_left(sharding.shard(ids, rank), k, sharding, group, fill=-100)
    want_ids = sharding.shard(_shift_reference(ids, k, bounds, -100), rank)
    leaf = sharding.shard(x, rank).requires_grad_()
    y = shift_left(leaf, k, sharding, group, fill=0.0)
    y.backward(sharding.shard(dy, rank))
    ref_leaf = x.clone().requires_grad_()
    ref_y = _shift_reference(ref_leaf, k, bounds, 0.0)
    ref_y.backward(dy)
    return {
        "ids": float((got_ids != want_ids).sum()),
        "values": (y - sharding.shard(ref_y, rank)).abs().max().item(),
        "grad": (leaf.grad - sharding.shard(ref_leaf.grad, rank)).abs().max().item(),
        "filled": float((want_ids == -100).sum()),  # positions past a document's end exist on some rank
    }


# ------------------------------------------------------------------------------------------------ model


def _model(family: str):
    from mcore.models.families import get_config
    from mcore.models.gpt import GPTModel

    extra = {"num_nextn_predict_layers": MTP_DEPTH} if family.startswith("deepseek") else {}
    model = GPTModel(get_config(family, **extra))
    model.init_weights(11)
    model.mtp_loss_weight = 0.3
    return model


def _batch(vocab: int, packed: bool):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, vocab, (B, S), generator=g)
    labels = torch.randint(0, vocab, (B, S), generator=g)
    labels[torch.rand(B, S, generator=g) < 0.2] = -100
    return ids, labels, (DOCS if packed else None)


@functools.cache
def _single_process(family: str, packed: bool):
    model = _model(family)
    ids, labels, bounds = _batch(model.config.vocab_size, packed)
    cu = None if bounds is None else torch.tensor(bounds, dtype=torch.int32)
    loss = model(ids, labels=labels, cu_seqlens=cu).sum() / (labels != -100).sum()
    loss.backward()  # the MTP loss joins with aux_loss_scale 1
    mtp = model.mtp.stats["mtp_loss"].item() if model.mtp is not None else None
    return loss.item(), mtp, {name: p.grad.clone() for name, p in model.named_parameters()}


def _check_model(name: str, groups) -> dict[str, float]:
    import torch.distributed as dist

    from mcore.parallel.context_parallel import CPSharding
    from mcore.parallel.cp_attention import CPContext

    family, comm_type, cp, packed = MODEL_CASES[name]
    model = _model(family)
    ids, labels, bounds = _batch(model.config.vocab_size, packed)
    sharding, rank = CPSharding(B, S, cp, bounds), dist.get_rank(groups.cp)
    context = CPContext(sharding, groups, comm_type)
    out = model(sharding.shard(ids, rank), labels=sharding.shard(labels, rank), context_parallel=context)
    loss = out.sum() / (labels != -100).sum()  # this rank's share of the micro-batch mean
    loss.backward()
    ref_loss, ref_mtp, ref_grads = _single_process(family, packed)
    errors = {"loss": abs(context.sum(loss).item() - ref_loss) / ref_loss}
    if ref_mtp is not None:
        errors["mtp_loss"] = abs(model.mtp.stats["mtp_loss"].item() - ref_mtp) / ref_mtp
    for pname, param in model.named_parameters():
        grad = context.sum(torch.zeros_like(param) if param.grad is None else param.grad)  # the dp x cp reduction
        want = ref_grads[pname]
        errors[pname] = (grad - want).norm().item() / max(want.norm().item(), 1e-30)
        if want.norm().item() == 0.0:  # an expert no token reached: must stay zero
            errors[pname] = grad.norm().item()
    return errors


# ------------------------------------------------------------------------------------------------ training

PACKED = ["data.mock=true", "data.packing=true"]
GPT_OSS = [
    "model=gpt_oss-tiny",
    "model.num_hidden_layers=2",
    "model.swiglu_limit=0.1",
]
DEEPSEEK = [
    "model=deepseek_v3-tiny",
    "model.num_nextn_predict_layers=1",
    "model.moe_router={score_function: sigmoid, expert_bias: true, n_group: 4, topk_group: 2, "
    "routed_scaling_factor: 2.5, bias_update_rate: 0.01, aux_loss_type: sequence}",
    "model.router_aux_loss_coef=0.01",  # sequence-wise: each sequence's statistics span its CP shards
    "train.mtp_loss_weight=0.3",
]
# packed documents, no expert bias or aux loss (those with CP's padding: test_cp_moe_padding.py)
DEEPSEEK_PACKED = [
    "model=deepseek_v3-tiny",
    "model.num_nextn_predict_layers=2",
    "model.moe_router={score_function: sigmoid, expert_bias: false, n_group: 4, topk_group: 2, "
    "routed_scaling_factor: 2.5}",
    "train.mtp_loss_weight=0.3",
    *PACKED,
]
MIXTRAL = [  # the global load-balancing loss and the z-loss, with the expert bias
    "model=mixtral-tiny",
    "model.router_aux_loss_coef=0.01",
    "model.moe_router={z_loss_coef: 0.001, expert_bias: true, bias_update_rate: 0.01}",
]
STEPS = ["train.steps=4", "train.global_batch_size=8", "checkpoint.save_at_end=false", "optim.eps=1e-6"]
REFERENCES = {"gpt_oss": GPT_OSS, "gpt_oss_packed": [*GPT_OSS, *PACKED], "deepseek": DEEPSEEK, "mixtral": MIXTRAL}
REFERENCES["deepseek_packed"] = DEEPSEEK_PACKED
REFERENCES["mixtral_packed64"] = ["model=mixtral-tiny", "data.packing=true", "data.seq_length=64"]
CP2, TP2_SP = ["parallel.cp=2"], ["parallel.tp=2", "parallel.sequence_parallel=true"]
# MTP on the last stage; MLA's up projections and core recomputed (the CP collectives run again in backward)
RECOMPUTE_MLA = ["train.recompute=selective", "train.recompute_modules=[mla_up_proj,core_attn,layernorm]"]
CP4_2X2 = ["parallel.cp=4", "parallel.cp_comm_type=a2a+p2p", "parallel.cp_a2a_size=2"]
RUNS = {  # name: (single-process reference, overrides of the 4-rank run)
    "gpt_oss_cp2_p2p_packed": ("gpt_oss_packed", CP2),
    "gpt_oss_cp4_a2a+p2p_2x2": ("gpt_oss", CP4_2X2),
    "gpt_oss_cp2_tp2_sp_packed": ("gpt_oss_packed", [*CP2, *TP2_SP]),
    "deepseek_mtp_cp2_a2a": ("deepseek", [*CP2, "parallel.cp_comm_type=a2a"]),
    "deepseek_mtp_cp2_tp2_sp": ("deepseek", [*CP2, *TP2_SP]),
    "deepseek_mtp_cp2_ep2": ("deepseek", [*CP2, "parallel.ep=2"]),
    "deepseek_mtp_cp2_pp2_recompute": (
        "deepseek",
        [*CP2, "parallel.pp=2", "parallel.pipeline_layout=balanced", *RECOMPUTE_MLA],
    ),
    "deepseek_mtp2_cp2_p2p_packed": ("deepseek_packed", CP2),  # two MTP depths across document ends
    "gpt_oss_cp2_ep4_packed": ("gpt_oss_packed", [*CP2, "parallel.ep=4"]),
    "mixtral_aux_cp4": ("mixtral", ["parallel.cp=4"]),
    "mixtral_dynamic_cp2_packed64": ("mixtral_packed64", [*CP2, "parallel.cp_dynamic=true"]),
    "mixtral_aux_cp2_tp2_sp": ("mixtral", [*CP2, *TP2_SP]),
}


def _train(run_dir, *overrides) -> tuple[list[tuple[float, float]], dict[str, list[float]], int]:
    """((loss, grad norm) by step, the expert biases at the end, the CP size) of one mcore-train run in this process."""
    from tests.train.tiny import train_keeping_trainer, train_records

    trainer = train_keeping_trainer(run_dir, *STEPS, *overrides)
    # lists, not tensors: a tensor sent from a worker that has exited cannot be opened by the parent
    biases = {n: b.tolist() for n, b, _ in trainer.named_local_buffers() if n.endswith("expert_bias")}
    curve = [(r["loss"], r["grad_norm"]) for _, r in sorted(train_records(run_dir).items())]
    return curve, biases, trainer.groups.cp_size


# ------------------------------------------------------------------------------------------------ workers


def _workers(rank: int, world_size: int, run_root: str):
    import torch.distributed as dist

    from mcore.parallel.cp_attention import new_cp_groups

    torch.set_num_threads(1)
    everyone = list(range(world_size))
    groups = {4: new_cp_groups(everyone), "2x2": new_cp_groups(everyone, a2a_size=2)}
    pairs = [new_cp_groups([0, 1]), new_cp_groups([2, 3])]  # two cp=2 groups running the same case
    groups[2] = pairs[rank // 2]
    cases = {}
    for cp, k, packed in SHIFT_CASES:
        cases[f"shift-cp{cp}-k{k}-{packed}"] = functools.partial(_check_shift, cp, k, packed, groups[cp].cp)
    for name, (_, comm_type, cp, _) in MODEL_CASES.items():
        group = groups["2x2" if comm_type == "a2a+p2p" else cp]
        cases[name] = functools.partial(_check_model, name, group)
    out = run_cases(cases)
    dist.barrier()
    for name, (reference, extra) in RUNS.items():
        out[name] = _train(f"{run_root}/{name}", *REFERENCES[reference], *extra)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("cp_sinks_mtp")
    singles = {name: _train(root / f"single-{name}", *extra) for name, extra in REFERENCES.items()}
    return singles, run_workers(4, _workers, str(root), timeout=600)


@pytest.mark.parametrize("cp,k,packed", SHIFT_CASES)
def test_shift_left_equals_the_single_process_shift(results, cp, k, packed):
    for rank, errors in enumerate(case_result(results[1], f"shift-cp{cp}-k{k}-{packed}")):
        assert errors["ids"] == 0 and errors["values"] == 0 and errors["grad"] < 1e-6, (rank, errors)
    assert sum(e["filled"] for e in case_result(results[1], f"shift-cp{cp}-k{k}-{packed}")) > 0


@pytest.mark.parametrize("name", list(MODEL_CASES))
def test_model_under_cp_equals_the_single_process(results, name):
    for rank, errors in enumerate(case_result(results[1], name)):
        bad = {key: value for key, value in errors.items() if value >= REL}
        assert not bad, (rank, bad)
        if name.startswith("deepseek"):
            assert "mtp_loss" in errors and any(key.startswith("mtp.layers.1.") for key in errors)
        else:
            assert any(key.endswith("sinks.weight") for key in errors)


@pytest.mark.parametrize("name", list(RUNS))
def test_training_under_cp_equals_the_single_process(results, name):
    singles, per_rank = results
    want_curve, want_biases, _ = singles[RUNS[name][0]]
    assert len(want_curve) == 4
    for rank, out in enumerate(per_rank):
        curve, biases, cp = out[name]
        assert cp == (4 if "cp4" in name else 2), (name, cp)
        assert len(curve) == len(want_curve), (rank, curve)
        for step, ((loss, norm), (want_loss, want_norm)) in enumerate(zip(curve, want_curve), start=1):
            assert loss == pytest.approx(want_loss, rel=REL, abs=0), (name, rank, step)
            assert norm == pytest.approx(want_norm, rel=REL, abs=0), (name, rank, step)
        if want_biases:
            assert biases and set(biases) <= set(want_biases), (rank, sorted(biases))  # a stage's layers under pp
            assert any(any(b) for b in want_biases.values())  # the biases moved
            for bias_name, bias in biases.items():
                assert bias == want_biases[bias_name], (name, rank, bias_name)
    if want_biases:  # every layer's bias on some rank, the MTP layer's included
        held = {n for out in per_rank for n in out[name][1]}
        assert held == set(want_biases) and ("mixtral" in name or any(n.startswith("mtp.") for n in held)), held
