"""The model split over 4 gloo ranks (tp=2 with and without sequence parallelism, pp=2 with 1F1B, tp=2 x pp=2)
gives the single-process loss and gradients over two SGD steps, and generates the same tokens at tp=2.

The workers are spawned once; every layout and family runs inside them. Each rank builds the reference
single-process model itself (same seed) and reports relative errors; the assertions run here.
"""

import pytest
import torch

from tests.helpers.distributed import run_workers
from tests.helpers.families import families

REL_TOL = 1e-5
SEQ, MICRO_BATCH, MICROBATCHES = 16, 2, 3
# name -> (tp, pp, sequence_parallel)
LAYOUTS = {
    "tp2": (2, 1, False),
    "tp2-sp": (2, 1, True),
    "pp2-1f1b": (1, 2, False),
    "tp2xpp2": (2, 2, False),
    "tp2xpp2-sp": (2, 2, True),
}
# Every registered family's tiny preset, plus tied embeddings (whose gradient is summed over pipeline stages).
FAMILIES = (*(f"{family}-tiny" for family in families()), "qwen2-tied")


def _config(name):
    from mcore.models.families import get_config

    if name == "qwen2-tied":
        return get_config("qwen2-tiny", tie_word_embeddings=True)
    # 4 layers so that each pipeline stage holds 2 (qwen3 keeps 2: one per stage; a preset with per-layer types keeps
    # its own count); mistral's window 8 < 16 tokens.
    if name == "qwen3-tiny" or get_config(name).layer_types is not None:
        return get_config(name)
    return get_config(name, num_hidden_layers=4)


def _microbatches(config, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(MICROBATCHES):
        ids = torch.randint(0, config.vocab_size, (MICRO_BATCH, SEQ), generator=g)
        labels = torch.randint(0, config.vocab_size, (MICRO_BATCH, SEQ), generator=g)
        labels[torch.rand(MICRO_BATCH, SEQ, generator=g) < 0.2] = -100
        # Packed documents in every other micro-batch (boundaries at each row end, as the contract requires).
        cu = torch.tensor([0, 5, 16, 23, 32], dtype=torch.int32) if i % 2 == 0 else None
        out.append({"ids": ids, "labels": labels, "cu_seqlens": cu})
    return out


def _mean_loss(per_token, labels):
    return per_token.sum() / (labels != -100).sum()


def _full_slice(full, param, tp_rank, tp, padded_rows):
    """This rank's slice of a full (tp=1) tensor, for a parameter laid out as ``param``."""
    from mcore.parallel.init import partition_slice

    if getattr(param, "vocab_padded_dim", None) is not None and full.shape[0] != padded_rows:
        full = torch.cat([full[: param.vocab_size], full.new_zeros(padded_rows - param.vocab_size, *full.shape[1:])])
    if not getattr(param, "tensor_parallel", False):
        return full
    return partition_slice(full, param.partition_dim, tp_rank, tp, param.partition_blocks)


def _rel_err(got, ref):
    scale = ref.abs().max().item()
    return (got - ref).abs().max().item() / max(scale, 1e-30)


def _run_layout(family, tp, pp, sp, rank, world_size):
    from mcore.models.gpt import GPTModel
    from mcore.parallel.expert_parallel import update_expert_biases
    from mcore.parallel.finalize import finalize_model_grads
    from mcore.parallel.grid import ParallelConfig, build_process_groups
    from mcore.parallel.pipeline import NoPipelining, OneFOneB, p2p_activation_shape, stage_layer_ranges

    config = _config(family)
    groups = build_process_groups(ParallelConfig(tp=tp, pp=pp), backend="gloo")
    ((start, end),) = stage_layer_ranges(config.num_hidden_layers, pp)[groups.pp_rank]
    stage = GPTModel(
        config,
        groups=groups,
        layer_range=(start, end),
        pre_process=groups.is_first_stage,
        post_process=groups.is_last_stage,
        sequence_parallel=sp,
    )
    stage.init_weights(42)
    reference = GPTModel(config)
    reference.init_weights(42)
    ref_params = dict(reference.named_parameters())
    padded = config.padded_vocab_size(tp)

    errors = {}
    init_err = max(
        _rel_err(p, _full_slice(ref_params[n].detach(), p, groups.tp_rank, tp, padded))
        for n, p in stage.named_parameters()
    )
    errors["init"] = init_err

    def forward_step(chunk, input_tensor, mb):
        kwargs = {"cu_seqlens": mb["cu_seqlens"]}
        if stage.post_process:
            kwargs["labels"] = mb["labels"]
        out = stage(mb["ids"], **kwargs) if stage.pre_process else stage(hidden_states=input_tensor, **kwargs)
        return _mean_loss(out, mb["labels"]) if stage.post_process else out

    schedule_cls = OneFOneB if pp > 1 else NoPipelining
    schedule = schedule_cls(
        [stage],
        num_microbatches=MICROBATCHES,
        pp_group=groups.pp,
        activation_shape=p2p_activation_shape(SEQ, MICRO_BATCH, config.hidden_size, tp_size=tp, sequence_parallel=sp),
        finalize_grads=lambda: finalize_model_grads([stage], groups),
    )
    lr = 0.5
    for step in range(2):
        mbs = _microbatches(config, seed=100 + step)
        losses = schedule.run(forward_step, mbs)
        ref_losses = []
        for mb in mbs:
            loss = _mean_loss(reference(mb["ids"], labels=mb["labels"], cu_seqlens=mb["cu_seqlens"]), mb["labels"])
            (loss / MICROBATCHES).backward()
            ref_losses.append(loss.detach())
        update_expert_biases([reference])  # as finalize_model_grads does for the stage (aux-loss-free MoE balancing)
        if stage.post_process:
            errors[f"loss{step}"] = max(_rel_err(a, b) for a, b in zip(losses, ref_losses))
        for n, p in stage.named_parameters():
            ref_grad = _full_slice(ref_params[n].grad, p, groups.tp_rank, tp, padded)
            errors[f"grad{step}:{n}"] = _rel_err(p.grad, ref_grad)
        with torch.no_grad():
            for p in list(stage.parameters()) + list(reference.parameters()):
                p -= lr * p.grad
                p.grad = None
    return errors


def _run_generate(rank, world_size):
    from mcore.models.families import get_config
    from mcore.models.generate import generate
    from mcore.models.gpt import GPTModel
    from mcore.parallel.grid import ParallelConfig, build_process_groups

    config = get_config("mistral-tiny", tie_word_embeddings=True)
    groups = build_process_groups(ParallelConfig(tp=2), backend="gloo")
    sharded, single = GPTModel(config, groups=groups), GPTModel(config)
    sharded.init_weights(9)
    single.init_weights(9)
    prompt = torch.randint(0, config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(1))
    greedy = torch.equal(generate(sharded, prompt, 16), generate(single, prompt, 16))
    sampled = [
        generate(m, prompt, 16, do_sample=True, top_p=0.9, generator=torch.Generator().manual_seed(3))
        for m in (sharded, single)
    ]
    return {"greedy": greedy, "sampled": torch.equal(*sampled)}


def _cases(rank, world_size):
    torch.manual_seed(0)
    results = {}
    for layout, (tp, pp, sp) in LAYOUTS.items():
        for family in FAMILIES:
            results[(layout, family)] = _run_layout(family, tp, pp, sp, rank, world_size)
    results["generate"] = _run_generate(rank, world_size)
    return results


@pytest.fixture(scope="module")
def results():
    return run_workers(4, _cases)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parallel_loss_and_grads_equal_single_process(results, layout, family):
    tp, pp, _ = LAYOUTS[layout]
    checked_loss = False
    for rank, per_rank in enumerate(results):
        errors = per_rank[(layout, family)]
        assert errors["init"] == 0.0, f"rank {rank}: initial weights differ from the single-process model"
        bad = {k: v for k, v in errors.items() if v > REL_TOL}
        assert not bad, f"rank {rank}: relative errors above {REL_TOL}: {bad}"
        checked_loss |= "loss0" in errors
        assert sum(k.startswith("grad0:") for k in errors) > 0
    assert checked_loss


def test_every_parameter_is_compared_somewhere(results):
    """The union of parameters compared over the ranks of each layout is the whole model."""
    from mcore.models.gpt import GPTModel

    for family in FAMILIES:
        names = {n for n, _ in GPTModel(_config(family)).named_parameters()}
        for layout in LAYOUTS:
            seen = {k.split(":", 1)[1] for r in results for k in r[(layout, family)] if k.startswith("grad1:")}
            assert seen == names, (layout, family, names ^ seen)


def test_generate_at_tp2_equals_single_process(results):
    for per_rank in results:
        assert per_rank["generate"] == {"greedy": True, "sampled": True}
