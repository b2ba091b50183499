# ruff: noqa  (a one-off CPU check, kept as run beside the session's results)
"""One forward+backward of the demo Llama (trained a bit in fp32 first) on real text: per-parameter gradient error of
each fp8 recipe (emulated exactly on CPU) against fp32."""

import copy, sys, torch

sys.path.insert(0, "/work/main/benchmarks")
from mcore.models.config import TransformerConfig
from mcore.models.gpt import GPTModel
from mcore.train.config import DEMO_MODEL
from mcore.parallel.low_precision import enable_low_precision
from mcore.kernels.low_precision_linear import Recipe

torch.manual_seed(0)
cfg = dict(DEMO_MODEL)
cfg.update(hidden_size=256, intermediate_size=768)
config = TransformerConfig(**cfg)
base = GPTModel(config)
# real text bytes
import pathlib

text = b"".join(p.read_bytes() for p in sorted(pathlib.Path("/usr/lib/python3.11").glob("*.py"))[:60])
data = torch.tensor(list(text[: 64 * 129 * 20]), dtype=torch.long) + 3


def batch(i):
    chunk = data[i * 64 * 129 : (i + 1) * 64 * 129].view(64, 129)
    return chunk[:, :-1], chunk[:, 1:]


opt = torch.optim.AdamW(base.parameters(), lr=3e-3)
for i in range(30):  # a little training so activations / gradients are not init-like
    x, y = batch(i % 19)
    loss = base(x, labels=y).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
print("fp32 loss after 30 steps", loss.item())
x, y = batch(19)


def grads(recipe):
    m = copy.deepcopy(base)
    if recipe:
        enable_low_precision(m, Recipe(recipe), keep=("output",))
    store = {}

    def fwd_hook(mod, inp, out):
        out.register_hook(lambda g: store.__setitem__("dx_embed", g.detach().clone()))

    m.embedding.register_forward_hook(fwd_hook)
    from mcore.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    local = store.setdefault("local", {})
    for name, mod in m.named_modules():
        if isinstance(mod, ColumnParallelLinear | RowParallelLinear) and name != "output":

            def hook(mod, inp, out, name=name):
                xin = inp[0]
                o = out[0] if isinstance(out, tuple) else out
                want_y = xin.detach().double() @ mod.weight.detach().double().t()
                store.setdefault("fwd", {})[name] = ((o.detach().double() - want_y).norm() / want_y.norm()).item()
                box = {}
                o.register_hook(lambda go: box.__setitem__("go", go.detach().double()))

                def on_in(gi, box=box, w=mod.weight):
                    want = box["go"].reshape(-1, box["go"].shape[-1]) @ w.detach().double()
                    local[name] = ((gi.detach().double().reshape(want.shape) - want).norm() / want.norm()).item()

                xin.register_hook(on_in)

            mod.register_forward_hook(hook)
    m.zero_grad()
    l = m(x, labels=y).mean()
    l.backward()
    out = {n: p.grad.detach().clone() for n, p in m.named_parameters()}
    out["dx_embed"] = store["dx_embed"]
    if recipe:
        print(
            f"   [{recipe}] local fwd errors:",
            {
                k.replace("layers.", "L").replace("attention.", "").replace("mlp.", ""): round(v, 4)
                for k, v in store["fwd"].items()
            },
        )
    if recipe:
        print(
            f"   [{recipe}] local dgrad errors:",
            {
                k.replace("layers.", "L").replace("attention.", "").replace("mlp.", ""): round(v, 4)
                for k, v in local.items()
            },
        )
    return l.item(), out


l0, g0 = grads(None)
rows = {}
for r in ("tensorwise", "rowwise", "blockwise"):
    l, g = grads(r)
    errs = {n: ((g[n] - g0[n]).norm() / g0[n].norm()).item() for n in g0}
    g0p = {k: v for k, v in g0.items() if k != "dx_embed"}
    cos = {n: torch.nn.functional.cosine_similarity(g[n].flatten(), g0[n].flatten(), dim=0).item() for n in g0}
    print(f"== {r}: loss {l:.5f} vs {l0:.5f}")
    for n in g0:
        if "embed" in n or n == "dx_embed":
            print(f"   {n:45s} rel {errs[n]:.4f} cos {cos[n]:.5f}")
    tot = torch.cat([(g[n] - g0[n]).flatten() for n in g0p]).norm() / torch.cat([g0[n].flatten() for n in g0p]).norm()
    print("   total rel", tot.item())
