"""Selective recompute by module (``recompute_modules``, Megatron's names): for each module, and for Megatron's
DeepSeek-V3 recipes, the loss and every gradient equal those without recompute bit for bit (fp32 CPU), the bytes
kept for backward (counted with saved-tensor hooks) drop, the MoE layer's token counts for the bias update are
counted once, and bad lists are one clear error."""

from __future__ import annotations

import pytest
import torch

from mcore.models.families import get_config
from mcore.models.gpt import GPTModel
from mcore.models.recompute import RECOMPUTE_MODULES, discard_output
from mcore.parallel.expert_parallel import MoELayer

DEEPSEEK = get_config("deepseek_v3-tiny")  # MLA with q-LoRA; a dense layer, then MoE layers with a shared expert
MOONLIGHT = get_config("deepseek_v3-tiny", q_lora_rank=None)  # MLA without q-LoRA, as Moonlight / V2-Lite
RECIPES = (["mla_up_proj", "mlp"], ["mla_up_proj", "moe", "mlp", "layernorm"], ["core_attn", "mla_up_proj"])


def _run(config, modules, *, recompute="selective", cu=True):
    """Loss, gradients, bytes saved for backward and the MoE layers' token counts of one forward + backward."""
    torch.manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (2, 24))
    cu_seqlens = torch.tensor([0, 10, 24, 31, 48], dtype=torch.int32) if cu else None
    model = GPTModel(config, recompute=recompute, recompute_modules=modules)
    model.init_weights(3)
    model.train()
    storages = {}  # what is saved for backward: each saved storage once
    held = []  # every saved tensor stays referenced until counted: a storage freed mid-forward (a graph branch that
    # dies, e.g. unused router statistics) must not hand its address to a later save, which would merge the two
    # in the count by address and make the total depend on the allocator (CI saw 192 bytes of such drift)

    def pack(t):
        held.append(t)
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(ids, labels=ids, cu_seqlens=cu_seqlens)
    total = sum(storages.values())
    held.clear()
    weights = torch.rand(loss.shape, generator=torch.Generator().manual_seed(1))
    (loss * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    counts = [m.step_tokens_per_expert.clone() for m in model.modules() if isinstance(m, MoELayer)]
    return loss.detach(), grads, total, counts


def _assert_same(ref, got):
    assert torch.equal(ref[0], got[0])
    assert ref[1].keys() == got[1].keys()
    for name, g in ref[1].items():
        assert torch.equal(got[1][name], g), name  # the same ops on the same values: bit-equal
    for a, b in zip(ref[3], got[3], strict=True):
        assert torch.equal(a, b)


@pytest.fixture(scope="module")
def baseline():
    return {name: _run(config, None, recompute=None) for name, config in (("v3", DEEPSEEK), ("moon", MOONLIGHT))}


@pytest.mark.parametrize("module", RECOMPUTE_MODULES)
@pytest.mark.parametrize("name", ["v3", "moon"])
def test_each_module_keeps_gradients_and_saves_bytes(baseline, module, name):
    config = DEEPSEEK if name == "v3" else MOONLIGHT
    ref = baseline[name]
    got = _run(config, [module])
    _assert_same(ref, got)
    if module == "moe_act":  # our experts never keep the activation: nothing more to drop
        assert got[2] == ref[2]
    else:
        assert got[2] < ref[2], (module, got[2], ref[2])


@pytest.mark.parametrize("modules", RECIPES)
def test_megatron_recipes_keep_gradients(baseline, modules):
    got = _run(DEEPSEEK, modules)
    _assert_same(baseline["v3"], got)
    singles = [baseline["v3"][2] - _run(DEEPSEEK, [m])[2] for m in modules]
    assert got[2] < baseline["v3"][2] - max(singles)  # the modules' savings add up


def test_up_projections_alone_keep_the_latents_not_q_k_v(baseline):
    """mla_up_proj drops at least q, k and v of every MLA layer (2 x heads x qk + heads x v values per token, fp32;
    v is a view of kv_up's output, whose whole storage goes)."""
    c = DEEPSEEK
    tokens, layers = 48, c.num_hidden_layers
    qkv = c.num_attention_heads * (2 * (c.qk_nope_head_dim + c.qk_rope_head_dim) + c.v_head_dim)
    saved = baseline["v3"][2] - _run(c, ["mla_up_proj"])[2]
    assert saved >= 4 * tokens * qkv * layers


def test_default_selective_is_unchanged(baseline):
    """Without a list, MLA recomputes its up-projections and core together (the default before the list)."""
    assert _run(DEEPSEEK, None)[2] == _run(DEEPSEEK, ["core_attn", "mla_up_proj"])[2]


@pytest.mark.parametrize("recompute,modules", [("full", None), ("selective", ["moe"])])
def test_recomputed_moe_counts_tokens_once(baseline, recompute, modules):
    got = _run(DEEPSEEK, modules, recompute=recompute)
    assert got[3] and all(c.sum() > 0 for c in got[3])
    _assert_same(baseline["v3"], got)


def test_dense_attention_model_modules():
    config = get_config("qwen3-tiny") if _has("qwen3-tiny") else get_config("llama3-tiny")
    ref = _run(config, None, recompute=None, cu=False)
    for modules in (["core_attn"], ["layernorm"], ["mlp"], ["layernorm", "mlp", "core_attn"]):
        got = _run(config, modules, cu=False)
        _assert_same(ref, got)
        assert got[2] < ref[2], modules


def _has(preset: str) -> bool:
    try:
        get_config(preset)
    except Exception:
        return False
    return True


def test_discard_output_rebuilds_views_and_refuses_shared_storage():
    x = torch.randn(4, 6, requires_grad=True)

    def producer(t):
        return (t * 2).t()  # a non-contiguous view

    out = discard_output(producer, (x,), lambda y: (y.exp() * y).sum())
    out.backward()
    ref = x.detach().clone().requires_grad_()
    ((ref * 2).t().exp() * (ref * 2).t()).sum().backward()
    torch.testing.assert_close(x.grad, ref.grad, rtol=0, atol=0)
    # what the consumer keeps still goes through the hooks active outside (activation offload, counters)
    seen = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t.shape) or t, lambda t: t):
        discard_output(producer, (x,), lambda y: (y.exp() * y.sin()).sum())
    # x (the producer checkpoint's input, and the rebuild's), exp's output (for exp and for the product) and sin(y);
    # not y (sin's input)
    assert sorted(seen) == sorted([torch.Size([4, 6])] * 2 + [torch.Size([6, 4])] * 3)
    with pytest.raises(ValueError, match="must not share storage"):
        discard_output(lambda t: (t * 2).split(3, dim=1), (x,), lambda a, b: (a * b).sum())


def test_nested_discards_free_the_outer_output():
    """A norm's discarded output feeding MLA's discarded up-projections (Moonlight: no q-LoRA) must not stay alive
    through the inner rebuild's inputs."""
    from torch.multiprocessing.reductions import StorageWeakRef

    x = torch.randn(8, 5, requires_grad=True)
    outer_outputs = []

    def norm(t):
        y = t * 3
        outer_outputs.append(StorageWeakRef(y.untyped_storage()))
        return y

    def consumer(y):
        return discard_output(lambda t: (t * 2).exp(), (y,), lambda z: (z * z.sin()).sum())

    out = discard_output(norm, (x,), consumer)
    assert outer_outputs[0].expired()
    out.backward()
    ref = x.detach().clone().requires_grad_()
    z = (ref * 3 * 2).exp()
    (z * z.sin()).sum().backward()
    torch.testing.assert_close(x.grad, ref.grad, rtol=0, atol=0)


@pytest.mark.parametrize(
    "modules,recompute,error,match",
    [
        (["mla_up", "mlp"], "selective", ValueError, r"unknown recompute_modules \['mla_up'\]; valid names"),
        (["mlp", "mlp"], "selective", ValueError, "lists a name twice"),
        (["mlp"], "full", ValueError, "needs recompute 'selective'"),
        (["mlp"], None, ValueError, "needs recompute 'selective'"),
        ("mlp", "selective", TypeError, "must be a list of names"),
    ],
)
def test_bad_lists_are_one_clear_error(modules, recompute, error, match):
    with pytest.raises(error, match=match):
        GPTModel(DEEPSEEK, recompute=recompute, recompute_modules=modules)


def test_train_config_validates_the_list():
    from mcore.train.config import TrainSection

    assert TrainSection(recompute="selective", recompute_modules=["mla_up_proj", "mlp"]).recompute_modules == [
        "mla_up_proj",
        "mlp",
    ]
    with pytest.raises(ValueError, match="valid names: .*core_attn"):
        TrainSection(recompute="selective", recompute_modules=["attention"])
    with pytest.raises(ValueError, match="needs recompute 'selective'"):
        TrainSection(recompute="none", recompute_modules=["mlp"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("packed", [False, True])  # SDPA (one document) and our Triton kernel (packed)
def test_cuda_bf16_modules_keep_gradients_and_drop_q_k_v(packed):
    """On CUDA the attention kernels must save q, k, v as the views they get (else mla_up_proj saves nothing)."""
    config = get_config("deepseek_v3-tiny", q_lora_rank=None)
    ids = torch.randint(0, config.vocab_size, (2, 64), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    cu = torch.tensor([0, 20, 64, 100, 128], dtype=torch.int32, device="cuda") if packed else None
    results = []
    for recompute, modules in ((None, None), ("selective", ["mla_up_proj"]), ("selective", RECIPES[1])):
        model = GPTModel(
            config, recompute=recompute, recompute_modules=modules, params_dtype=torch.bfloat16, device="cuda"
        )
        model.init_weights(3)
        storages = {}

        def pack(t, storages=storages):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(ids, labels=ids, cu_seqlens=cu)
        loss.float().mean().backward()
        grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
        results.append((loss.detach().float(), grads, sum(storages.values())))
    c = config
    qkv = 2 * 128 * c.num_attention_heads * (2 * (c.qk_nope_head_dim + c.qk_rope_head_dim) + c.v_head_dim)
    assert results[0][2] - results[1][2] >= qkv * c.num_hidden_layers
    assert results[2][2] < results[1][2]
    for loss, grads, _ in results[1:]:
        torch.testing.assert_close(loss, results[0][0], rtol=1e-3, atol=1e-3)  # the forward runs the same ops
        for name, g in results[0][1].items():
            torch.testing.assert_close(grads[name], g, rtol=2e-2, atol=1e-3, msg=name)
