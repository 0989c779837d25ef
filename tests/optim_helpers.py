"""Small models, batches and training loops shared by the optimizer tests (tiny, CPU-fast)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from geomopt.models import GPT, GPTConfig, MLP

ROOT = Path(__file__).resolve().parents[1]
SPECS = ROOT / "specs"
SHIPPED = sorted(SPECS.glob("*.yaml"))

# CPU always; CUDA cases only where a GPU exists (not a skip of a CPU case)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

GPT_CFG = dict(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16)


def tiny_gpt(seed: int = 0, device="cpu", dtype=torch.float32, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**GPT_CFG, **overrides})).to(device=device, dtype=dtype)


def tiny_mlp(seed: int = 0, device="cpu", dtype=torch.float32, d_in=8, width=16, depth=2, d_out=4) -> MLP:
    torch.manual_seed(seed)
    return MLP(d_in=d_in, width=width, depth=depth, d_out=d_out).to(device=device, dtype=dtype)


def gpt_batch(step: int = 0, device="cpu", batch: int = 4):
    g = torch.Generator().manual_seed(1000 + step)
    idx = torch.randint(0, GPT_CFG["vocab_size"], (batch, GPT_CFG["block_size"]), generator=g)
    tgt = torch.randint(0, GPT_CFG["vocab_size"], (batch, GPT_CFG["block_size"]), generator=g)
    return idx.to(device), tgt.to(device)


def mlp_batch(step: int = 0, device="cpu", dtype=torch.float32, batch: int = 16, d_in=8, d_out=4):
    g = torch.Generator().manual_seed(2000 + step)
    x = torch.randn(batch, d_in, generator=g)
    y = torch.randint(0, d_out, (batch,), generator=g)
    return x.to(device=device, dtype=dtype), y.to(device)


def loss_of(model, batch):
    if isinstance(model, GPT):
        return model(*batch)[1]
    x, y = batch
    return F.cross_entropy(model(x).float(), y)


def train(model, opt, steps: int, batch_fn=None, *, start: int = 0, closure: bool = False, scheduler=None) -> list[float]:
    """Plain loop; ``batch_fn(k)`` gives step k's batch (None: one fixed batch)."""
    losses = []
    for k in range(start, start + steps):
        batch = batch_fn(k) if batch_fn else None

        def closure_fn():
            opt.zero_grad()
            loss = loss_of(model, batch)
            loss.backward()
            return loss

        if closure:
            losses.append(float(opt.step(closure_fn).detach()))
        else:
            losses.append(float(closure_fn().detach()))
            opt.step()
        if scheduler is not None:
            scheduler.step()
    return losses


def clone_model(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


def params_equal(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def snapshot(opt) -> list:
    """Every tensor and scalar of the optimizer's state, cloned (for exact before/after checks)."""
    out = []
    for group in opt.param_groups:
        for p in group["params"]:
            out.append(p.detach().clone())
            st = opt.state.get(p, {})
            for k in sorted(st):
                v = st[k]
                out.append((k, v.detach().clone() if torch.is_tensor(v) else copy.deepcopy(v)))
        out.append({k: copy.deepcopy(v) for k, v in group.items() if k != "params"})
    return out


def same_snapshot(a: list, b: list) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if torch.is_tensor(x):
            if not (torch.is_tensor(y) and x.dtype == y.dtype and torch.equal(x, y)):
                return False
        elif isinstance(x, tuple):
            if x[0] != y[0]:
                return False
            if torch.is_tensor(x[1]):
                if not (torch.is_tensor(y[1]) and x[1].dtype == y[1].dtype and torch.equal(x[1], y[1])):
                    return False
            elif x[1] != y[1]:
                return False
        elif x != y:
            return False
    return True


def step_in_lockstep(models: list, opts: list, steps: int = 4, setup=None, drop_at: int = 2) -> None:
    """Step two tiny GPTs with their optimizers on the same batches (the first MLP's c_fc gradient
    dropped at step ``drop_at``), asserting bit-equal parameters after every step; ``setup(i)``
    runs before model i steps."""
    for step in range(steps):
        for i, (model, opt) in enumerate(zip(models, opts)):
            if setup is not None:
                setup(i)
            opt.zero_grad(set_to_none=True)
            loss_of(model, gpt_batch(step)).backward()
            if step == drop_at:
                model.transformer.h[0].mlp.c_fc.weight.grad = None
            opt.step()
        for (n, a), b in zip(models[0].named_parameters(), models[1].parameters()):
            assert torch.equal(a, b), (step, n)
