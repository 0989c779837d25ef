"""Models the lint fixtures are linted against, by the name a fixture's ``# target:`` header gives
(tests/lint_fixtures/README.md). The built-in models (``geomopt.models.MODELS``: mlp, cnn, gpt, …)
are named directly; these are the small ones a rule needs that the package does not ship."""

from __future__ import annotations

import torch
from torch import nn

from geomopt.compile.compiler import model_params
from geomopt.compile.match import ParamInfo
from geomopt.models import GPT, GPTConfig, MODELS


def frozen_gpt():
    """The built-in GPT with its position embedding frozen (GO110)."""
    model = GPT(GPTConfig())
    model.transformer.wpe.weight.requires_grad_(False)
    return model


def tied_gpt():
    """The built-in GPT with its embedding tied to its head, as GPT-2's (GO111)."""
    return GPT(GPTConfig(tie_weights=True))


class _Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(4, 16, 8))
        self.w_out = nn.Parameter(torch.randn(4, 8, 16))


class MoE(nn.Module):
    """A mixture-of-experts block (router + 4 batched experts) and a head (GO116, GO117)."""

    def __init__(self):
        super().__init__()
        self.block = nn.Module()
        self.block.gate = nn.Linear(8, 4, bias=False)
        self.block.experts = _Experts()
        self.block.proj = nn.Linear(8, 8, bias=False)
        self.head = nn.Linear(8, 3)


class TwoHeads(nn.Module):
    """Two last layers reading the same features: both are heads (GO119)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.head_a = nn.Linear(8, 3)
        self.head_b = nn.Linear(8, 5)


class Scan(nn.Module):
    """A state-space-like block: a (8, 4) decay table used only through ``exp`` (the module tree
    calls it a hidden matrix; the trace sees an elementwise use: GO125), a projection and a head;
    it brings its own inputs for the trace."""

    def __init__(self):
        super().__init__()
        self.A_log = nn.Parameter(torch.zeros(8, 4))
        self.proj = nn.Linear(4, 8, bias=False)
        self.head = nn.Linear(8, 3)

    def example_inputs(self):
        return torch.zeros(2, 4)

    def forward(self, x):
        h = self.proj(x) * torch.exp(-self.A_log.exp()).sum(-1)
        return self.head(h)


class LoraLinear(nn.Module):
    """A LoRA-adapted linear layer laid out as peft's ``lora.Linear`` is (``base_layer``, and
    ``lora_dropout``, ``lora_A``, ``lora_B`` as ModuleDicts keyed by adapter name)."""

    def __init__(self, base: nn.Linear, r: int = 4):
        super().__init__()
        self.base_layer = base
        self.lora_dropout = nn.ModuleDict({"default": nn.Identity()})
        self.lora_A = nn.ModuleDict({"default": nn.Linear(base.in_features, r, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(r, base.out_features, bias=False)})

    def forward(self, x):
        return self.base_layer(x) + self.lora_B["default"](self.lora_A["default"](self.lora_dropout["default"](x)))


def lora(model: nn.Module, targets: tuple[str, ...]) -> nn.Module:
    """``model`` with the linear layers whose attribute name is in ``targets`` LoRA-adapted and
    every other tensor frozen, as ``peft.get_peft_model(model, LoraConfig(target_modules=…))``
    leaves it (peft also puts the model under ``base_model.model.``; names do not matter here)."""
    for name, mod in list(model.named_modules()):
        if isinstance(mod, nn.Linear) and name.rpartition(".")[2] in targets:
            parent = model.get_submodule(name.rpartition(".")[0])
            setattr(parent, name.rpartition(".")[2], LoraLinear(mod))
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name)
    return model


def lora_gpt():
    """The built-in GPT with LoRA on its attention and MLP projections (GO103: the catch-all rule
    of a role spec has nothing left to take, and is not shadowed)."""
    return lora(GPT(GPTConfig()), ("c_attn", "c_proj", "c_fc"))


def lora_mlp():
    """The built-in MLP with LoRA on every linear layer, its head included."""
    from geomopt.models import MLP

    return lora(MLP(), ("0", "1", "head"))


FACTORIES = {
    "lora-gpt": lora_gpt,
    "lora-mlp": lora_mlp,
    "frozen-gpt": frozen_gpt,
    "tied-gpt": tied_gpt,
    "moe": MoE,
    "two-heads": TwoHeads,
    "scan": Scan,
    "linear-4x3": lambda: nn.Linear(4, 3),  # a weight and a 1-D bias (GO104)
    "qkv-64x192": lambda: nn.Linear(64, 192, bias=False),  # a fused q, k, v projection (GO104's view)
}


def target_params(target: str):
    """(ParamInfos or None, from a checkpoint) for a fixture's ``# target:`` value: ``none``,
    ``checkpoint name=AxB …`` (a scalar: ``name=``), or a model's name (built-in or :data:`FACTORIES`)."""
    words = target.split()
    if words == ["none"]:
        return None, False
    if words[0] == "checkpoint":
        rows = [w.split("=", 1) for w in words[1:]]
        return [ParamInfo(name=n, shape=tuple(int(d) for d in s.split("x") if d), modules=None) for n, s in rows], True
    (name,) = words
    factory = MODELS.get(name) or FACTORIES.get(name)
    assert factory is not None, f"unknown target {name!r}: a built-in model or a name in lint_fixtures/models.py"
    return model_params(factory())[0], False

