"""DDP's ``zero_grad_buffer`` leaves the experts' weight-gradient regions unfilled (their first GEMM of a step writes
them: ``param_attrs.take_wgrad_target``), and nothing changes: on 2 gloo ranks, over three steps of three
micro-batches (one of 3 tokens, so most experts get no rows in it; expert 7 never gets a row: its router bias is
-30), GPT-OSS's biased experts (the biases go through DDP's hook, still zero-filled), plain DDP and ZeRO-1, with and
without overlapped reduction, experts in the dense buffers or their own, fp32 and bf16 main grads, the gradient
buffers, losses, grad norms and weights equal bit for bit those of the zero-filling path (``skip_overwritten_fill
=False``). The buffers are poisoned with NaN before every ``zero_grad_buffer``: the expert weights' regions keep
the NaN after it (they were not written by it), everything else is zero, and every result is finite. Single
process: a parameter that gets no gradient in a step is zero when its bucket is reduced, and a writer that adds
(DDP's hook, a fused linear) finds zeros; every expert GEMM mode (grouped, per_expert, grouped_fp32_wgrad) gives the
zero-filled gradients bit for bit, on CPU and (``@pytest.mark.gpu``) on CUDA in bf16."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from mcore.parallel import DistributedDataParallel, DistributedOptimizer, MixedPrecisionOptimizer, MoELayer
from mcore.parallel.expert_biases import use_gpt_oss_options
from mcore.parallel.param_attrs import fused_wgrad_target
from tests.helpers.distributed import run_workers
from tests.parallel._moe import BASE

TOKENS = (3, 12, 7)  # per micro-batch
STEPS, LR, CLIP = 3, 0.05, 0.5
# name: (use_distributed_optimizer, overlap_grad_reduce, grad dtype, experts in their own buffers)
CASES = {
    "ddp_overlap": (False, True, torch.float32, False),
    "ddp_no_overlap_expert_buffers": (False, False, torch.float32, True),
    "zero1_overlap": (True, True, torch.float32, False),
    "zero1_expert_buffers": (True, True, torch.float32, True),
    "ddp_bf16_grads": (False, True, torch.bfloat16, False),
    "zero1_bf16_grads": (True, False, torch.bfloat16, True),
}


def _layer() -> MoELayer:
    layer = MoELayer(BASE)
    use_gpt_oss_options(layer, router_bias=True, expert_biases=True, activation=(1.702, 0.6))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        layer.router.bias[7] = -30.0  # expert 7 gets no token in any micro-batch
    return layer


def _batch(rank: int, step: int, micro: int):
    g = torch.Generator().manual_seed(10_000 * rank + 100 * step + micro)
    n = TOKENS[micro] + rank  # the ranks' micro-batches differ
    return torch.randn(n, BASE.hidden_size, generator=g), torch.randn(n, BASE.hidden_size, generator=g)


def _run(rank: int, case: str, skip: bool) -> dict:
    distopt, overlap, grad_dtype, own_buffers = CASES[case]
    layer = _layer()
    world = dist.group.WORLD
    ddp = DistributedDataParallel(
        layer,
        world,
        bucket_size=700,  # several buckets; expert weights share some with the biases and the router
        overlap_grad_reduce=overlap,
        use_distributed_optimizer=distopt,
        grad_dtype=grad_dtype,
        expert_dp_group=world if own_buffers else "dense",
        skip_overwritten_fill=skip,
    )
    cls = DistributedOptimizer if distopt else MixedPrecisionOptimizer
    opt = cls(ddp, lr=LR, clip_grad=CLIP, fused_step=grad_dtype != torch.float32)
    weights = (layer.experts.gate_up, layer.experts.down)
    out = {"grads": [], "losses": [], "norms": [], "unfilled": [], "rest_zero": True}
    for step in range(STEPS):
        for buf in ddp.grad_buffers:
            buf.grad_data.fill_(float("nan"))
        opt.zero_grad()
        out["unfilled"].append([bool(torch.isnan(w.main_grad).all()) for w in weights])
        others = [p.main_grad for p in layer.parameters() if all(p is not w for w in weights)]
        out["rest_zero"] &= all(bool((g == 0).all()) for g in others)
        loss = 0.0
        for micro in range(len(TOKENS)):
            x, probe = _batch(rank, step, micro)
            with ddp.no_sync() if micro < len(TOKENS) - 1 else torch.enable_grad():
                micro_loss = (ddp(x) * probe).sum()
                micro_loss.backward()
            loss += float(micro_loss.detach())
        ddp.finish_grad_sync()
        out["grads"].append([buf.grad_data.clone() for buf in ddp.grad_buffers])
        out["starved"] = [bool((w.main_grad[7] == 0).all()) for w in weights]
        out["norms"].append(float(opt.step().grad_norm))
        out["losses"].append(loss)
    ddp.finish_param_sync()
    out["weights"] = [p.detach().clone() for p in layer.parameters()]
    return out


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _compare(rank: int, case: str) -> dict:
    """Plain facts (tensors do not outlive a spawned worker): what the test asserts."""
    filled, skipped = _run(rank, case, skip=False), _run(rank, case, skip=True)
    return {
        "unfilled": (filled["unfilled"], skipped["unfilled"]),
        "rest_zero": filled["rest_zero"] and skipped["rest_zero"],
        "starved": skipped["starved"],
        "equal": {key: _equal(skipped[key], filled[key]) for key in ("grads", "losses", "norms", "weights")},
        "finite": all(bool(torch.isfinite(t).all()) for t in [*sum(skipped["grads"], []), *skipped["weights"]]),
    }


def _cases(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    return {case: _compare(rank, case) for case in CASES}


@pytest.fixture(scope="module")
def results():
    return run_workers(2, _cases)


@pytest.mark.parametrize("case", list(CASES))
def test_unfilled_expert_regions_give_the_zero_filled_results_bit_for_bit(results, case):
    for rank, by_case in enumerate(results):
        facts = by_case[case]
        filled, skipped = facts["unfilled"]
        # the zero-filling path fills everything; the skipping one leaves the expert weights from the 2nd step on
        assert filled == [[False, False]] * STEPS, (rank, filled)
        assert skipped == [[False, False]] + [[True, True]] * (STEPS - 1), (rank, skipped)
        assert facts["rest_zero"], rank  # every other region (biases, router, padding) zeroed in both
        assert facts["starved"] == [True, True], rank  # the expert without rows: zeros written over the NaN
        assert facts["equal"] == dict.fromkeys(("grads", "losses", "norms", "weights"), True), (rank, facts["equal"])
        assert facts["finite"], rank


# ---- single process: parameters that no overwriting GEMM writes in a step


class _TwoLayers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = _layer(), _layer()

    def forward(self, x, use_b: bool = True):
        y = self.a(x)
        return self.b(y) if use_b else y


def _poisoned_step(ddp: DistributedDataParallel, x: torch.Tensor, *, use_b: bool) -> None:
    for buf in ddp.grad_buffers:
        buf.grad_data.fill_(float("nan"))
    ddp.zero_grad_buffer()
    ddp(x, use_b=use_b).square().sum().backward()


@pytest.mark.parametrize("overlap", [True, False])
def test_a_parameter_without_gradient_in_a_step_is_zero_when_reduced(overlap):
    model = _TwoLayers()
    ddp = DistributedDataParallel(model, None, bucket_size=500, overlap_grad_reduce=overlap)
    x = torch.randn(6, BASE.hidden_size, generator=torch.Generator().manual_seed(3))
    _poisoned_step(ddp, x, use_b=True)  # both layers' experts overwrite: marked for the next step
    ddp.finish_grad_sync()
    _poisoned_step(ddp, x, use_b=False)  # layer b gets no gradient at all
    assert torch.isnan(model.b.experts.gate_up.main_grad).all()  # not filled by zero_grad_buffer...
    ddp.finish_grad_sync()
    for p in model.b.parameters():  # ...but zero once its bucket is reduced
        assert torch.equal(p.main_grad, torch.zeros_like(p.main_grad))
    for p in model.a.parameters():
        assert torch.isfinite(p.main_grad).all()


def test_writers_that_add_find_zeros_in_an_unfilled_main_grad():
    model = _TwoLayers()
    ddp = DistributedDataParallel(model, None)
    x = torch.randn(6, BASE.hidden_size, generator=torch.Generator().manual_seed(3))
    _poisoned_step(ddp, x, use_b=True)
    ddp.finish_grad_sync()
    for buf in ddp.grad_buffers:
        buf.grad_data.fill_(float("nan"))
    ddp.zero_grad_buffer()
    w, v = model.a.experts.down, model.b.experts.down
    assert torch.isnan(w.main_grad).all() and torch.isnan(v.main_grad).all()
    # DDP's hook adds a .grad (a use of the weight outside the expert GEMMs): zeros first
    (w * 2.0).sum().backward()
    assert torch.equal(w.main_grad, torch.full_like(w.main_grad, 2.0))
    # a fused linear's GEMM accumulates into main_grad: it gets zeros
    target = fused_wgrad_target(v)
    assert target is v.main_grad and torch.equal(target, torch.zeros_like(target))
    ddp.finish_grad_sync()
    assert all(torch.isfinite(p.main_grad).all() for p in model.parameters())


def test_skip_overwritten_fill_off_fills_everything():
    model = _TwoLayers()
    ddp = DistributedDataParallel(model, None, skip_overwritten_fill=False)
    x = torch.randn(6, BASE.hidden_size, generator=torch.Generator().manual_seed(3))
    _poisoned_step(ddp, x, use_b=True)
    for buf in ddp.grad_buffers:
        buf.grad_data.fill_(float("nan"))
    ddp.zero_grad_buffer()
    assert all(torch.equal(buf.grad_data, torch.zeros_like(buf.grad_data)) for buf in ddp.grad_buffers)


# ---- every expert GEMM mode, on CPU and (GPU machine) on CUDA in bf16


def _mode_run(gemm: str, device: str, skip: bool) -> tuple[list[list[torch.Tensor]], list[bool]]:
    """Two poisoned steps of two micro-batches (one of 3 tokens): each step's main_grads, and whether the expert
    weights' regions kept the poison through zero_grad_buffer."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    align = {"align": 8} if device == "cuda" else {}  # torch._grouped_mm's row alignment, as the experts' GPU test
    layer = MoELayer(replace(BASE, expert_gemm=gemm, **align), params_dtype=dtype, device=device)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    ddp = DistributedDataParallel(layer, None, skip_overwritten_fill=skip)
    weights = (layer.experts.gate_up, layer.experts.down)
    grads, kept = [], []
    for step in range(2):
        for buf in ddp.grad_buffers:
            buf.grad_data.fill_(float("nan"))
        ddp.zero_grad_buffer()
        kept.append(all(bool(torch.isnan(w.main_grad).all()) for w in weights))
        for micro, n in enumerate((3, 40)):
            x = torch.randn(n, BASE.hidden_size, generator=torch.Generator().manual_seed(10 * step + micro))
            with ddp.no_sync() if micro == 0 else torch.enable_grad():
                ddp(x.to(device, dtype)).float().square().sum().backward()
        ddp.finish_grad_sync()
        grads.append([p.main_grad.clone() for p in layer.parameters()])
    return grads, kept


@pytest.mark.parametrize("gemm", ["grouped", "per_expert", "grouped_fp32_wgrad"])
@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
        ),
    ],
)
def test_every_expert_gemm_mode_gives_the_zero_filled_gradients(gemm, device):
    filled, kept_filled = _mode_run(gemm, device, skip=False)
    skipped, kept_skipped = _mode_run(gemm, device, skip=True)
    assert kept_filled == [False, False] and kept_skipped == [False, True]
    for step_filled, step_skipped in zip(filled, skipped, strict=True):
        for a, b in zip(step_filled, step_skipped, strict=True):
            assert torch.isfinite(b).all() and torch.equal(a, b)


# ---- the dense tensor-parallel linears: their step's first weight-gradient GEMM overwrites main_grad too

WIDTH = 16


def _dense_net(tied: bool) -> torch.nn.Module:
    """Column -> tanh -> Row (tp group of one); ``tied``: an embedding whose weight the Column layer also uses (the
    tied LM head: its GEMM overwrites, then DDP's hook adds the embedding's ``.grad``)."""
    from mcore.parallel import ColumnParallelLinear, RowParallelLinear

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(2 * WIDTH, WIDTH) if tied else None
            self.col = ColumnParallelLinear(WIDTH, 2 * WIDTH, bias=True)
            self.row = RowParallelLinear(2 * WIDTH, WIDTH)
            if tied:
                self.col.weight = self.embed.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.embed is not None:
                x = x + self.embed(torch.arange(x.shape[0], device=x.device) % (2 * WIDTH)).sum(0)
            return self.row(torch.tanh(self.col(x)))

    torch.manual_seed(5)
    return Net()


def _counting(fn, calls: dict, key: str):
    def counted(*args):
        calls[key] += 1
        return fn(*args)

    return counted


def _dense_run(tied: bool, skip: bool, device: str = "cpu", monkeypatch=None) -> dict:
    """Three poisoned steps of two micro-batches through DDP + the mixed-precision optimizer."""
    import mcore.parallel.tensor_parallel as tp_module

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = _dense_net(tied).to(device, dtype)
    ddp = DistributedDataParallel(model, None, bucket_size=200, skip_overwritten_fill=skip)
    opt = MixedPrecisionOptimizer(ddp, lr=LR, clip_grad=CLIP, fused_step=device == "cuda")
    calls = {"write": 0, "add": 0}
    if monkeypatch is not None:
        for name, key in (("write_weight_grad_", "write"), ("accumulate_weight_grad_", "add")):
            monkeypatch.setattr(tp_module, name, _counting(getattr(tp_module, name), calls, key))
    out = {"grads": [], "losses": [], "kept": [], "calls": calls}
    for step in range(STEPS):
        for buf in ddp.grad_buffers:
            buf.grad_data.fill_(float("nan"))
        opt.zero_grad()
        out["kept"].append([bool(torch.isnan(m.weight.main_grad).all()) for m in (model.col, model.row)])
        loss = 0.0
        for micro in range(2):
            x = torch.randn(6, WIDTH, generator=torch.Generator().manual_seed(10 * step + micro)).to(device, dtype)
            with ddp.no_sync() if micro == 0 else torch.enable_grad():
                micro_loss = ddp(x).float().square().mean()
                micro_loss.backward()
            loss += float(micro_loss.detach())
        ddp.finish_grad_sync()
        out["grads"].append([buf.grad_data.clone() for buf in ddp.grad_buffers])
        out["losses"].append(loss)
        opt.step()
    out["weights"] = [p.detach().clone() for p in model.parameters()]
    return out


def _dense_reference_grads(tied: bool) -> list[torch.Tensor]:
    """The first step's gradients by plain autograd (two micro-batches summed) on the same model."""
    model = _dense_net(tied)
    for micro in range(2):
        x = torch.randn(6, WIDTH, generator=torch.Generator().manual_seed(micro))
        model(x).square().mean().backward()
    return [p.grad for p in model.parameters()]


@pytest.mark.parametrize("tied", [False, True])
def test_dense_linears_overwrite_main_grad_and_match_the_zero_filled_run(tied, monkeypatch):
    filled = _dense_run(tied, skip=False)
    skipped = _dense_run(tied, skip=True, monkeypatch=monkeypatch)
    # each linear weight: written by the first micro-batch's GEMM, added to by the second, in every step
    assert skipped["calls"] == {"write": 2 * STEPS, "add": 2 * STEPS}, skipped["calls"]
    assert filled["kept"] == [[False, False]] * STEPS
    assert skipped["kept"] == [[False, False]] + [[True, True]] * (STEPS - 1)  # left unfilled from the 2nd step
    for key in ("grads", "losses", "weights"):
        assert _equal(skipped[key], filled[key]), key
    assert all(bool(torch.isfinite(g).all()) for g in sum(skipped["grads"], []))
    # the written-then-added gradients are the plain autograd ones
    model = _dense_net(tied)
    ddp = DistributedDataParallel(model, None, bucket_size=200)
    ddp.zero_grad_buffer()
    for micro in range(2):
        x = torch.randn(6, WIDTH, generator=torch.Generator().manual_seed(micro))
        with ddp.no_sync() if micro == 0 else torch.enable_grad():
            ddp(x).square().mean().backward()
    ddp.finish_grad_sync()
    for p, ref in zip(model.parameters(), _dense_reference_grads(tied), strict=True):
        torch.testing.assert_close(p.main_grad, ref, rtol=1e-6, atol=1e-7)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tied", [False, True])
def test_dense_linears_overwrite_main_grad_on_cuda_in_bf16(tied):
    filled, skipped = _dense_run(tied, skip=False, device="cuda"), _dense_run(tied, skip=True, device="cuda")
    assert skipped["kept"] == [[False, False]] + [[True, True]] * (STEPS - 1)
    for key in ("grads", "losses", "weights"):
        assert _equal(skipped[key], filled[key]), key


@pytest.mark.parametrize(
    "device,dtype",
    [
        ("cpu", torch.float32),
        ("cpu", torch.bfloat16),
        pytest.param(
            "cuda",
            torch.bfloat16,
            marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
        ),
    ],
)
def test_write_weight_grad_does_not_read_its_target(device, dtype):
    from mcore.parallel.tensor_parallel import write_weight_grad_

    g = torch.Generator().manual_seed(7)
    grad_out, x = (torch.randn(64, n, generator=g).to(device, dtype) for n in (48, 32))
    target = torch.full((48, 32), float("nan"), device=device)
    write_weight_grad_(target, grad_out, x)
    exact = grad_out.double().t() @ x.double()
    assert torch.isfinite(target).all()
    # fp32 operands: fp32 rounding of the GEMM; bf16 operands: accumulated in fp32 on CUDA, a bf16 product on CPU
    tol = 1e-5 if dtype == torch.float32 or device == "cuda" else 1e-2
    torch.testing.assert_close(target.double(), exact, rtol=tol, atol=tol * exact.abs().max().item())
