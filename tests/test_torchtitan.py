"""torchtitan (the `torchtitan` extra; .ci/run installs it): its OptimizersContainer built from a
geomopt spec named in its own config objects, on its llama3 "debugmodel" (random init, CPU,
float32). Training steps through torchtitan's container and LR scheduler give the parameters a
plain GeomOptimizer gives, bit for bit, and the container's flat state dict resumes exactly.

The debug model as shipped cannot take a training step on CPU (its attention backends, tested
below: FlexAttention has no CPU backward, varlen needs a CUDA flash kernel, sdpa is refused for
language models), so the steps run on the debug model with its inner attention replaced by
torchtitan's ScaledDotProductAttention (causal; the same attention for one document per row)."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torchtitan
from torch.nn.attention.flex_attention import create_block_mask
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer, ParamGroupConfig
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
from torchtitan.models.llama3 import model_registry

import geomopt
from geomopt.integrations.torchtitan import GeomOptimizersContainer, geomopt_optimizer, spec_of

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 2048  # the debug model's


def debug_model(attn_backend: str = "flex", sdpa: bool = False) -> torch.nn.Module:
    """torchtitan's llama3 debugmodel as its trainer builds it (meta device, then init_weights on
    CPU, float32); ``sdpa``: its FlexAttention configs replaced by ScaledDotProductAttention's."""
    config = model_registry("debugmodel", attn_backend=attn_backend).model
    if sdpa:
        for _fqn, _cfg, parent, attr in list(config.traverse(FlexAttention.Config)):
            setattr(parent, attr, ScaledDotProductAttention.Config())
    torch.manual_seed(0)
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model.train()


def loss_of(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, one document per row (positions 0..L-1, as torchtitan passes them)."""
    logits = model(tokens, positions=torch.arange(tokens.shape[1]).expand_as(tokens))
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


def same_parameters(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def cloned(state: dict) -> dict:
    """A saved state dict, as a checkpoint on disk would hold it (later steps do not change it)."""
    return {k: v.clone() if torch.is_tensor(v) else copy.deepcopy(v) for k, v in state.items()}


@pytest.fixture(scope="module")
def model():
    """The debug model as shipped (FlexAttention), read only."""
    return debug_model()


def test_torchtitan_version():
    assert torchtitan.__version__.startswith("0.3."), torchtitan.__version__


def test_the_container_holds_a_geomoptimizer_planned_as_a_plain_one(model):
    config = GeomOptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=r".*", optimizer_name="geomopt:muon")])
    assert geomopt_optimizer("muon") == config  # the shorthand, as default_adamw is AdamW's
    container = config.build(model_parts=[model])
    assert isinstance(container, OptimizersContainer) and len(container) == 1
    (opt,) = container.optimizers
    assert isinstance(opt, geomopt.GeomOptimizer)
    plain = geomopt.GeomOptimizer(model, "muon")
    assert opt.plan == plain.plan  # same rules, geometries and hyper-parameters per tensor
    assert {p.name: p.rule for p in opt.plan}["layers.0.attention.qkv_linear.wqkv.weight"] == "hidden"
    assert [g["param_names"] for g in opt.param_groups] == [g["param_names"] for g in plain.param_groups]
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in model.parameters()}


def test_geomopt_and_torchtitans_adamw_share_a_model(model):
    config = GeomOptimizersContainer.Config(param_groups=[
        ParamGroupConfig(pattern=r"norm\.weight$", optimizer_name="AdamW",
                         optimizer_kwargs={"lr": 1e-3, "weight_decay": 0.0}),
        ParamGroupConfig(pattern=r".*", optimizer_name="geomopt:muon"),
    ])
    adamw, geo = config.build(model_parts=[model]).optimizers
    assert isinstance(adamw, torch.optim.AdamW) and isinstance(geo, geomopt.GeomOptimizer)
    norms = {n for n, _ in model.named_parameters() if n.endswith("norm.weight")}
    assert set(adamw.param_groups[0]["param_names"]) == norms and len(norms) == 13
    assert not norms & {p.name for p in geo.plan}
    assert len(geo.plan) == len(list(model.parameters())) - len(norms)


def test_config_lr_and_weight_decay_fill_what_the_spec_leaves_unset(model, tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text("geomopt: 1\nname: tt\nrules:\n"
                    "  - {name: hidden, match: {name: 'layers.**.weight', ndim: 2}, geometry: {kind: spectral, "
                    "reference: {kind: indicator}, approx: {kind: newton_schulz}}}\n"
                    "  - {name: rest, match: '**', geometry: {kind: adam}, lr: 0.001, weight_decay: 0.0}\n",
                    encoding="utf-8")
    config = geomopt_optimizer(str(path), lr=0.05, weight_decay=0.01)
    assert config.param_groups[0].optimizer_name == f"geomopt:{path}"
    (opt,) = config.build(model_parts=[model]).optimizers
    groups = {g["rule"]: (g["lr"], g["weight_decay"]) for g in opt.param_groups}
    assert groups == {"hidden": (0.05, 0.01), "rest": (0.001, 0.0)}  # a rule's own values win
    # muon sets lr and weight_decay in its defaults: the config's are not used
    assert spec_of("geomopt:muon", {"lr": 0.5, "weight_decay": 0.0}) == geomopt.load_spec("muon")


@pytest.mark.parametrize("name", ["geomopt:no-such-spec", "geomopt:", "geomopt:missing/spec.yaml", "muon", "Muon"])
def test_a_bad_name_says_what_to_write(model, name):
    config = GeomOptimizersContainer.Config(param_groups=[ParamGroupConfig(pattern=r".*", optimizer_name=name)])
    with pytest.raises(ValueError, match="optimizer_name='geomopt:<spec>'.*shipped spec's name"):
        config.build(model_parts=[model])


def test_bad_input_fails_early_and_clearly(model):
    with pytest.raises(ValueError, match="geomopt:<spec>"):
        geomopt_optimizer("no-such-spec")
    config = GeomOptimizersContainer.Config(param_groups=[
        ParamGroupConfig(pattern=r".*", optimizer_name="geomopt:muon",
                         optimizer_kwargs={"lr": 0.02, "betas": (0.9, 0.95)})])
    with pytest.raises(ValueError, match="only lr and weight_decay.*not betas"):
        config.build(model_parts=[model])


def test_the_shipped_debug_model_cannot_train_on_cpu(model):
    """Why the steps below swap the attention: each language-model backend of torchtitan 0.3."""
    flex = model.layers["0"].attention.inner_attention
    assert isinstance(flex, FlexAttention)
    q = torch.randn(1, 128, 16, 16, requires_grad=True)
    mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, 1, None, 128, 128, device="cpu")
    with pytest.raises(NotImplementedError, match="FlexAttention does not support backward on CPU"):
        flex(q, q, q, attention_masks=mask)
    varlen = debug_model("varlen")
    tokens = torch.zeros(1, 8, dtype=torch.long)
    positions = torch.arange(8)[None]
    with pytest.raises(NotImplementedError, match="_flash_attention_forward.*CPU"):
        varlen(tokens, positions=positions, attention_masks=varlen.get_attention_masks(positions=positions))
    with pytest.raises(ValueError, match="sdpa is no longer supported for language models"):
        model_registry("debugmodel", attn_backend="sdpa")


# torchtitan's LRSchedulersContainer.load_state_dict calls LambdaLR.get_lr(), which torch warns about
@pytest.mark.filterwarnings("ignore:To get the last learning rate computed by the scheduler:UserWarning")
def test_training_steps_match_a_plain_geomoptimizer_and_resume_exactly():
    model = debug_model(sdpa=True)
    reference = copy.deepcopy(model)
    assert same_parameters(model, reference)
    config = GeomOptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=r".*", optimizer_name="geomopt:muon")])
    schedule = LRSchedulersContainer.Config(warmup_steps=1, decay_ratio=0.5, min_lr_factor=0.1)
    container = config.build(model_parts=[model])
    sched = schedule.build(optimizers=container, training_steps=4)
    plain = geomopt.GeomOptimizer(reference, "muon")
    plain_sched = torch.optim.lr_scheduler.LambdaLR(plain, sched.schedulers[0].lr_lambdas[0])
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, VOCAB, (2, 32), generator=gen) for _ in range(2)]

    def step(opt, lrs, net, tokens):
        opt.zero_grad()
        loss_of(net, tokens).backward()
        opt.step()
        lrs.step()

    step(container, sched, model, batches[0])
    step(plain, plain_sched, reference, batches[0])
    assert not same_parameters(model, debug_model(sdpa=True))  # it trained
    assert same_parameters(model, reference)
    # a checkpoint now, as torchtitan's CheckpointManager takes one: the model, the container's flat
    # FQN-keyed optimizer state, the schedulers' last_epoch
    saved_model = copy.deepcopy(model)
    saved, saved_sched = cloned(container.state_dict()), sched.state_dict()
    assert "state.layers.0.attention.wo.weight.d" in saved  # Muon's momentum, under torchtitan's FQN
    assert "state.tok_embeddings.weight.exp_avg_sq" in saved and "param_groups.norm.weight.lr" in saved
    step(container, sched, model, batches[1])
    step(plain, plain_sched, reference, batches[1])
    assert same_parameters(model, reference)
    # resume as torchtitan does: build the container and schedulers, then load their states
    resumed_container = config.build(model_parts=[saved_model])
    resumed_sched = schedule.build(optimizers=resumed_container, training_steps=4)
    resumed_container.load_state_dict(saved)
    resumed_sched.load_state_dict(saved_sched)
    step(resumed_container, resumed_sched, saved_model, batches[1])
    assert same_parameters(saved_model, model)
    assert resumed_container.optimizers[0].param_groups[2]["lr"] == container.optimizers[0].param_groups[2]["lr"]


def test_geomopt_imports_without_torchtitan():
    code = ("import sys; sys.modules['torchtitan'] = None\n"  # any import of torchtitan now fails
            "import geomopt, geomopt.integrations\nassert geomopt.GeomOptimizer")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
