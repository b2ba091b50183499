"""Megatron's precision-aware optimizer in mcore.parallel: bf16 gradient buffers (``grad_dtype``: accumulation with
the linears' fused weight-gradient GEMMs, reduction and clipping in bf16) and bf16 Adam moments, on the toy LM.

Tolerances. With every state in fp32 the dp2 ZeRO-1 run equals the single process to 1e-5 (checked here too).
In bf16 the gradients of the dp ranks add up in another order, each partial sum rounded to bf16 (2**-9 relative),
so the dp2 run is not bit-equal to the single process with the same dtypes: it is held to ``BF16_DP_TOL`` over
``STEPS`` steps (loss 1e-4, grad norm 2e-3, parameters 1e-2; measured 7e-6, 3e-4, 3.6e-3, the same order as the
single-process bf16 run's distance from the fp32 one, 2.2e-3). Both runs use Adam ``eps`` = ``DP_EPS`` = 1e-3:
with 1e-8 a gradient element that cancels to within rounding of zero (1-2 elements of the toy's 1000-element
matrices: exactly 0.0 in one summation order, +-1e-6 in the other) takes a full +-lr sign step in one run and
none in the other, a 2e-2 error of its whole tensor that says nothing about the reduction. That the bf16 path is
used at all is checked apart: its buffers and moments are bf16 and it is *not* equal to the fp32 run.
"""

from __future__ import annotations

import pytest
import torch

from mcore.parallel import (
    DistributedDataParallel,
    DistributedOptimizer,
    MixedPrecisionOptimizer,
    ParallelConfig,
    ProcessGroups,
    build_process_groups,
    default_param_groups,
)
from tests.helpers.distributed import run_workers
from tests.parallel import _training as T
from tests.parallel._helpers import rel_err, rel_err_norm
from tests.parallel._toy_model import ParallelToyLM

BF16 = torch.bfloat16
STEPS = 5
BF16_DP_TOL = {"loss": 1e-4, "norm": 2e-3, "params": 1e-2}
DP_EPS = 1e-3


def _build(
    groups,
    *,
    grad_dtype,
    moments,
    distributed=True,
    dtype=torch.float32,
    fused_step=None,
    eps=1e-8,
    device=None,
    **optimizer_kwargs,
):
    model = ParallelToyLM(T.CFG, groups, dtype=dtype, device=device)
    model.init_weights(T.SEED)
    ddp = DistributedDataParallel(
        model, groups.dp_cp, bucket_size=1500, use_distributed_optimizer=distributed, grad_dtype=grad_dtype
    )
    cls = DistributedOptimizer if distributed else MixedPrecisionOptimizer
    opt = cls(
        ddp, default_param_groups(ddp, T.WEIGHT_DECAY), lr=T.LR, clip_grad=T.CLIP, groups=groups,
        exp_avg_dtype=moments, exp_avg_sq_dtype=moments, fused_step=fused_step, eps=eps, **optimizer_kwargs,
    )  # fmt: skip
    return model, ddp, opt


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def _errors(run, ref_run, ref_params) -> dict[str, float]:
    return {
        "loss": rel_err(torch.tensor(run.losses), torch.tensor(ref_run.losses)),
        "norm": rel_err(torch.tensor(run.norms), torch.tensor(ref_run.norms)),
        "params": max(rel_err_norm(p.float(), ref_params[n]) for n, p in run.model.named_parameters()),
    }


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_bf16_grads_and_moments_are_used_and_stay_close_to_fp32(dtype, monkeypatch):
    """One process: bf16 buffers and moments are what the step reads and keeps (fused step chosen on CPU), the
    weight-gradient GEMMs accumulate into the bf16 buffer, and 5 steps stay within 2e-2 of the fp32-state run
    without being equal to it."""
    import mcore.parallel.tensor_parallel as tp_mod

    fused_into: list[torch.dtype] = []
    original = tp_mod.accumulate_weight_grad_
    monkeypatch.setattr(
        tp_mod, "accumulate_weight_grad_", lambda g, *a: (fused_into.append(g.dtype), original(g, *a))[1]
    )
    groups = ProcessGroups.single()
    runs = {}
    for low in (False, True):
        state = BF16 if low else torch.float32
        model, ddp, opt = _build(groups, grad_dtype=state, moments=state, dtype=dtype)
        assert opt.fused_step is (low or False)  # CPU: torch's AdamW unless a state is bf16
        runs[low] = T.train(groups, ddp, opt, range(STEPS))
        ddp.finish_param_sync()
        runs[low].model = model
        if low:
            assert {buf.grad_data.dtype for buf in ddp.grad_buffers} == {BF16}
            states = [opt._adam.state[pc.master] for pc in opt._pieces]
            assert {st[k].dtype for st in states for k in ("exp_avg", "exp_avg_sq")} == {BF16}
            assert {pc.master.dtype for pc in opt._pieces} == {torch.float32}
    assert BF16 in fused_into and torch.float32 in fused_into  # both runs fused their weight gradients
    errs = _errors(runs[True], runs[False], _params(runs[False].model))
    assert max(errs.values()) <= 2e-2, errs
    assert errs["params"] >= 1e-5, errs  # not the fp32 run in disguise


def test_fused_step_false_with_bf16_moments_and_bad_dtypes_are_clear_errors():
    groups = ProcessGroups.single()
    with pytest.raises(ValueError, match=r"fused_step=False runs torch.optim.AdamW.*exp_avg=bfloat16"):
        _build(groups, grad_dtype=torch.float32, moments=BF16, fused_step=False)
    with pytest.raises(ValueError, match=r"exp_avg_dtype must be torch.float32 or torch.bfloat16, got torch.float16"):
        _build(groups, grad_dtype=torch.float32, moments=torch.float16)
    with pytest.raises(ValueError, match=r"exp_avg_dtype must be .* got 'bf16'"):
        _build(groups, grad_dtype=torch.float32, moments="bf16")
    # bf16 gradients alone may still take torch's step (it upcasts a copy): allowed when asked for explicitly
    _, _, opt = _build(groups, grad_dtype=BF16, moments=torch.float32, fused_step=False)
    assert not opt.fused_step


def test_host_offload_with_bf16_states_equals_the_device_step():
    """Half the optimizer offloaded with bf16 gradients and moments: mcore's host update is chosen (torch's cannot
    keep bf16 moments) and 3 steps give the non-offloaded run's parameters; asking for torch's is an error."""
    groups = ProcessGroups.single()
    runs = {}
    for fraction in (0.0, 0.5):
        model, ddp, opt = _build(groups, grad_dtype=BF16, moments=BF16, offload_fraction=fraction)
        runs[fraction] = T.train(groups, ddp, opt, range(3))
        if fraction:
            assert opt._offload.impl == "mcore" and opt._offload.indices
            assert {opt._adam.state[opt._pieces[i].master]["exp_avg"].dtype for i in opt._offload.indices} == {BF16}
        ddp.finish_param_sync()
        runs[fraction].model = model
    errs = _errors(runs[0.5], runs[0.0], _params(runs[0.0].model))
    assert max(errs.values()) <= 1e-6, errs
    with pytest.raises(ValueError, match=r"offload_impl='fused' runs torch's AdamW.*exp_avg, exp_avg_sq in bf16"):
        _build(groups, grad_dtype=BF16, moments=BF16, offload_fraction=0.5, offload_impl="fused")


@pytest.mark.parametrize(("save", "load"), [(torch.float32, BF16), (BF16, torch.float32), (BF16, BF16)])
def test_state_dict_keeps_the_moment_dtype_and_loads_across_dtypes(save, load):
    """Saved at one moment dtype (replicated optimizer), loaded at another (ZeRO-1): the tensors keep their dtype,
    the load casts (and says so in ``load_casts``) and training resumes from the cast values."""
    groups = ProcessGroups.single()
    _, ddp, opt = _build(groups, grad_dtype=torch.float32, moments=save, distributed=False)
    T.train(groups, ddp, opt, range(2))
    state = opt.state_dict()
    for key, t in state["tensors"].items():
        assert t.dtype == (torch.float32 if key.endswith("/master") else save), key
    _, ddp2, opt2 = _build(groups, grad_dtype=torch.float32, moments=load, distributed=True)
    opt2.load_state_dict(state)
    expected_casts = (
        [] if save == load else [f"exp_avg: {_n(save)} -> {_n(load)}", f"exp_avg_sq: {_n(save)} -> {_n(load)}"]
    )
    assert opt2.load_casts == expected_casts
    again = opt2.state_dict()["tensors"]
    for key, t in state["tensors"].items():
        assert again[key].dtype == (torch.float32 if key.endswith("/master") else load), key
        assert torch.equal(again[key], t.to(again[key].dtype)), key  # the cast, nothing else
    run = T.train(groups, ddp2, opt2, range(2, 4))
    assert all(torch.isfinite(torch.tensor(run.losses)))


def _n(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dp2_cases(rank: int, world_size: int) -> dict:
    """ZeRO-1 at dp = 2 against the single process (computed in this worker, no collective), per dtype choice."""
    groups = build_process_groups(ParallelConfig(tp=1))
    out = {}
    for name, grads, moments in (("fp32", torch.float32, torch.float32), ("bf16", BF16, BF16)):
        model1, ddp1, opt1 = _build(ProcessGroups.single(), grad_dtype=grads, moments=moments, eps=DP_EPS)
        single = T.train(ProcessGroups.single(), ddp1, opt1, range(STEPS))
        ddp1.finish_param_sync()
        model, ddp, opt = _build(groups, grad_dtype=grads, moments=moments, eps=DP_EPS)
        out[f"{name} buffers"] = sorted({str(b.grad_data.dtype) for b in ddp.grad_buffers})
        out[f"{name} split"] = any(pc.lo > 0 or pc.hi < pc.param.numel() for pc in opt._pieces)
        run = T.train(groups, ddp, opt, range(STEPS))
        ddp.finish_param_sync()
        run.model = model
        out[name] = _errors(run, single, _params(model1))
        state = opt.state_dict()  # collective: gathered over dp in the storage dtype
        out[f"{name} state dtypes"] = sorted({str(t.dtype) for k, t in state["tensors"].items() if "/exp_avg" in k})
    return out


@pytest.fixture(scope="module")
def dp2():
    return run_workers(2, _dp2_cases)


def test_zero1_dp2_with_bf16_main_grads_equals_the_single_process(dp2):
    for rank, out in enumerate(dp2):
        assert out["fp32 split"] and out["bf16 split"], rank  # shards cut parameters mid-tensor
        assert out["bf16 buffers"] == ["torch.bfloat16"] and out["fp32 buffers"] == ["torch.float32"], rank
        assert max(out["fp32"].values()) <= 1e-5, (rank, out["fp32"])
        assert all(out["bf16"][k] <= tol for k, tol in BF16_DP_TOL.items()), (rank, out["bf16"])
        assert out["bf16 state dtypes"] == ["torch.bfloat16"] and out["fp32 state dtypes"] == ["torch.float32"]


@pytest.mark.gpu
def test_cuda_bf16_model_with_bf16_states_runs_triton_and_tracks_fp32_states(monkeypatch):
    """On CUDA (bf16 parameters, the Triton step, the mixed-dtype wgrad GEMM into a bf16 buffer): 5 steps with bf16
    gradients and moments within 2e-2 of the same model with fp32 states, and not equal to it.

    Adam ``eps`` is ``DP_EPS`` here for the reason the module docstring gives: with 1e-8 an element whose gradient
    cancels to within rounding of zero takes a full +-lr step in one run and none in the other. On the H200
    (2026-12-01) that put one toy tensor 5.8e-2 away at eps 1e-8 while loss (1.2e-5) and grad norm (5e-4) agreed;
    the same comparison on CPU gives 1.5e-2 at 1e-8 and 4.5e-3 at 1e-3."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import mcore.kernels.triton.adamw as triton_adamw

    calls = []
    original = triton_adamw.adamw_step
    monkeypatch.setattr(triton_adamw, "adamw_step", lambda *a: (calls.append(a[2][0].dtype), original(*a))[1])
    groups = ProcessGroups.single()
    runs = {}
    for state in (torch.float32, BF16):
        model, ddp, opt = _build(groups, grad_dtype=state, moments=state, dtype=BF16, device="cuda", eps=DP_EPS)
        runs[state] = T.train(groups, ddp, opt, range(STEPS))
        ddp.finish_param_sync()
        runs[state].model = model
    assert set(calls) == {torch.float32, BF16}  # the kernel ran with both moment dtypes
    errs = _errors(runs[BF16], runs[torch.float32], _params(runs[torch.float32].model))
    assert max(errs.values()) <= 2e-2 and errs["params"] > 0, errs
