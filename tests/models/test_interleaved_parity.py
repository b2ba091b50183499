"""The model split over 2 gloo pipeline ranks with the interleaved 1F1B schedule (vpp=2: each rank holds two
non-contiguous layer ranges) and with the zero-bubble ZB-H1 schedule gives the single-process loss and every
gradient over two SGD steps, with tied and untied embeddings.

The workers are spawned once; every schedule and embedding variant runs inside them. Each rank builds the
reference single-process model itself (same seed) and reports relative errors; the assertions run here.
"""

import pytest
import torch

from tests.helpers.distributed import run_workers

REL_TOL = 1e-5
PP = 2
SEQ, MICRO_BATCH, MICROBATCHES = 16, 2, 4
LR = 0.5
# name -> model chunks per rank
SCHEDULES = {"interleaved-vpp2": 2, "zb-h1": 1}
TIED = (False, True)


def _config(tied):
    from mcore.models.families import get_config

    # 4 layers: one per virtual stage at pp=2 x vpp=2; llama-tiny's vocab (320) is not a multiple of 128.
    return get_config("llama-tiny", num_hidden_layers=4, tie_word_embeddings=tied)


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


def _full_rows(full, param, padded_rows):
    """The reference tensor laid out as ``param`` (vocab rows padded with zeros to ``padded_rows``)."""
    if getattr(param, "vocab_padded_dim", None) is not None and full.shape[0] != padded_rows:
        full = torch.cat([full[: param.vocab_size], full.new_zeros(padded_rows - param.vocab_size, *full.shape[1:])])
    return full


def _rel_err(got, ref):
    scale = ref.abs().max().item()
    return (got - ref).abs().max().item() / max(scale, 1e-30)


def _zero_bubble_recording_weight_passes():
    """ZeroBubbleH1 that counts, per W pass, the parameters whose gradient the pass changed: a W pass that
    changes nothing would mean the backward was not split at all."""
    from mcore.parallel.pipeline import ZeroBubbleH1

    class Recording(ZeroBubbleH1):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.weight_pass_updates = []

        def _weight_pass(self, chunk, microbatch):
            params = list(self.model_chunks[chunk].parameters())
            before = [None if p.grad is None else p.grad.clone() for p in params]
            super()._weight_pass(chunk, microbatch)
            changed = sum(
                (b is None) != (p.grad is None) or (b is not None and not torch.equal(b, p.grad))
                for b, p in zip(before, params)
            )
            self.weight_pass_updates.append(changed)

    return Recording


def _run_schedule(schedule_name, tied, rank, world_size):
    from mcore.models.gpt import GPTModel
    from mcore.parallel.finalize import finalize_model_grads
    from mcore.parallel.grid import ParallelConfig, build_process_groups
    from mcore.parallel.pipeline import Interleaved1F1B, p2p_activation_shape, stage_layer_ranges, virtual_stage_index

    vpp = SCHEDULES[schedule_name]
    config = _config(tied)
    groups = build_process_groups(ParallelConfig(pp=PP, vpp=vpp), backend="gloo")
    last_stage = PP * vpp - 1
    chunks = []
    for c, (start, end) in enumerate(stage_layer_ranges(config.num_hidden_layers, PP, vpp)[groups.pp_rank]):
        stage = virtual_stage_index(groups.pp_rank, c, PP)
        chunk = GPTModel(
            config, groups=groups, layer_range=(start, end), pre_process=stage == 0, post_process=stage == last_stage
        )
        chunk.init_weights(42)
        chunks.append(chunk)
    reference = GPTModel(config)
    reference.init_weights(42)
    ref_params = dict(reference.named_parameters())
    padded = config.padded_vocab_size(1)

    errors = {}
    names = [n for chunk in chunks for n, _ in chunk.named_parameters()]
    if len(names) != len(set(names)):
        raise AssertionError(f"a parameter name appears in two chunks of rank {rank}: {sorted(names)}")
    errors["init"] = max(
        _rel_err(p, _full_rows(ref_params[n].detach(), p, padded))
        for chunk in chunks
        for n, p in chunk.named_parameters()
    )
    shared = {n: bool(getattr(p, "shared_embedding", False)) for chunk in chunks for n, p in chunk.named_parameters()}

    def forward_step(chunk_index, input_tensor, mb):
        chunk = chunks[chunk_index]
        kwargs = {"cu_seqlens": mb["cu_seqlens"]}
        if chunk.post_process:
            kwargs["labels"] = mb["labels"]
        out = chunk(mb["ids"], **kwargs) if chunk.pre_process else chunk(hidden_states=input_tensor, **kwargs)
        return _mean_loss(out, mb["labels"]) if chunk.post_process else out

    schedule_cls = Interleaved1F1B if vpp > 1 else _zero_bubble_recording_weight_passes()
    schedule = schedule_cls(
        chunks,
        num_microbatches=MICROBATCHES,
        pp_group=groups.pp,
        activation_shape=p2p_activation_shape(SEQ, MICRO_BATCH, config.hidden_size),
        finalize_grads=lambda: finalize_model_grads(chunks, groups),
    )
    params = [p for chunk in chunks for p in chunk.parameters()]
    for step in range(2):
        mbs = _microbatches(config, seed=100 + step)
        losses = schedule.run(forward_step, mbs)
        ref_losses = []
        for mb in mbs:
            loss = _mean_loss(reference(mb["ids"], labels=mb["labels"], cu_seqlens=mb["cu_seqlens"]), mb["labels"])
            (loss / MICROBATCHES).backward()
            ref_losses.append(loss.detach())
        if any(chunk.post_process for chunk in chunks):
            if len(losses) != MICROBATCHES:
                raise AssertionError(f"rank {rank} holds the last stage but got {len(losses)} losses")
            errors[f"loss{step}"] = max(_rel_err(a, b) for a, b in zip(losses, ref_losses))
        for chunk in chunks:
            for n, p in chunk.named_parameters():
                errors[f"grad{step}:{n}"] = _rel_err(p.grad, _full_rows(ref_params[n].grad, p, padded))
        with torch.no_grad():
            for p in params + list(reference.parameters()):
                p -= LR * p.grad
                p.grad = None
    weight_pass_updates = getattr(schedule, "weight_pass_updates", None)
    return {"errors": errors, "shared_embedding": shared, "weight_pass_updates": weight_pass_updates}


def _cases(rank, world_size):
    torch.manual_seed(0)
    return {(name, tied): _run_schedule(name, tied, rank, world_size) for name in SCHEDULES for tied in TIED}


@pytest.fixture(scope="module")
def results():
    return run_workers(PP, _cases)


@pytest.mark.parametrize("tied", TIED, ids=["untied", "tied"])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_pipeline_loss_and_grads_equal_single_process(results, schedule, tied):
    checked_loss = False
    for rank, per_rank in enumerate(results):
        errors = per_rank[(schedule, tied)]["errors"]
        assert errors["init"] == 0.0, f"rank {rank}: initial weights differ from the single-process model"
        bad = {k: v for k, v in errors.items() if v > REL_TOL}
        assert not bad, f"rank {rank}: relative errors above {REL_TOL}: {bad}"
        checked_loss |= "loss0" in errors and "loss1" in errors
    assert checked_loss, "no rank reported the losses"


@pytest.mark.parametrize("tied", TIED, ids=["untied", "tied"])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_every_parameter_is_compared_on_exactly_one_rank(results, schedule, tied):
    """The ranks' chunks together hold the whole model, each parameter once (the tied embedding twice)."""
    from mcore.models.gpt import GPTModel

    names = {n for n, _ in GPTModel(_config(tied)).named_parameters()}
    per_rank = [{k.split(":", 1)[1] for k in r[(schedule, tied)]["errors"] if k.startswith("grad1:")} for r in results]
    assert set().union(*per_rank) == names
    on_both = per_rank[0] & per_rank[1]
    assert on_both == ({"embedding.weight"} if tied else set())


@pytest.mark.parametrize("tied", TIED, ids=["untied", "tied"])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_only_the_tied_embedding_copies_are_shared(results, schedule, tied):
    for per_rank in results:
        shared = {n for n, s in per_rank[(schedule, tied)]["shared_embedding"].items() if s}
        assert shared == ({"embedding.weight"} if tied else set())


@pytest.mark.parametrize("tied", TIED, ids=["untied", "tied"])
def test_zero_bubble_weight_passes_compute_weight_gradients(results, tied):
    """Every W pass (one per micro-batch and step) fills in weight gradients the B pass left out."""
    for rank, per_rank in enumerate(results):
        updates = per_rank[("zb-h1", tied)]["weight_pass_updates"]
        assert len(updates) == 2 * MICROBATCHES, f"rank {rank}: {updates}"
        assert min(updates) > 0, f"rank {rank}: a W pass changed no gradient: {updates}"
