"""What frameworks that read ``param_groups[0]`` see (Hugging Face's Trainer logs its ``lr``): the
shipped specs put their main rule first, so under ``muon`` (and the catalogue entries that extend
it) group 0 is the hidden matrices' rule with the spec's lr 0.02, not an AdamW rule's 0.001. The
reorder moved no tensor: every tensor of several models routes to the same rule in both orders."""

from __future__ import annotations

import pytest
import torch

import geomopt
from geomopt.compile import compile_spec
from geomopt.models import get_model

#: the order of muon's rules before the main rule came first
EARLIER = ["embeddings", "head", "hidden", "rest"]
MUON_FAMILY = ["muon", "adamuon", "muon-cautious-wd", "muon-gram-ns", "normuon", "normuon-rms", "muon-moonlight",
               "muon-polar-express", "namo", "muon-hyperball", "spel", "muon-cans"]


def in_earlier_order(spec):
    by_name = {r.name: r for r in spec.rules}
    assert sorted(by_name) == sorted(EARLIER)
    return spec.model_copy(update={"rules": [by_name[n] for n in EARLIER]})


def hf_models():
    import transformers
    with torch.device("meta"):
        yield "gpt2", transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64))
        yield "llama", transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256))


def routes(plan) -> dict:
    return {pp.name: pp.rule for pp in plan}


@pytest.mark.parametrize("name", MUON_FAMILY)
def test_group_zero_is_the_hidden_rule_with_the_spec_lr(name):
    spec = geomopt.load_spec(name)
    assert spec.rules[0].name == "hidden"
    torch.manual_seed(0)
    opt = geomopt.GeomOptimizer(get_model("gpt"), name)
    first = opt.param_groups[0]
    assert first["rule"] == "hidden" and first["lr"] == spec.defaults.lr
    if name != "muon-moonlight":  # Moonlight's scale gives the hidden matrices AdamW's lr: one lr for all
        assert any(g["lr"] != first["lr"] for g in opt.param_groups[1:])  # what group 0 used to show


def test_the_order_routes_every_tensor_as_before():
    """muon's rules route by role, one role per tensor, and hidden's roles are not the others':
    both orders give every tensor the same rule on geomopt's models and on a Hugging Face GPT-2 and
    Llama (built from their configs on the meta device)."""
    spec = geomopt.load_spec("muon")
    earlier = in_earlier_order(spec)
    torch.manual_seed(0)
    models = [(m, get_model(m)) for m in ("gpt", "mlp", "cnn")] + list(hf_models())
    for label, model in models:
        now, before = routes(compile_spec(spec, model)), routes(compile_spec(earlier, model))
        assert now == before, label
        assert "hidden" in set(now.values()) and len(set(now.values())) > 1, label  # several rules in use


@pytest.mark.parametrize("name", MUON_FAMILY[1:])
def test_the_catalogue_entries_that_extend_muon_keep_its_order_and_matches(name):
    muon, spec = geomopt.load_spec("muon"), geomopt.load_spec(name)
    assert [(r.name, r.match) for r in spec.rules] == [(r.name, r.match) for r in muon.rules]


def test_a_checkpoint_of_the_earlier_order_resumes_bit_for_bit_with_allow_spec_change():
    earlier = in_earlier_order(geomopt.load_spec("muon"))
    torch.manual_seed(0)
    model = get_model("gpt")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    old = geomopt.GeomOptimizer(model, earlier)

    def grads(m, k):
        g = torch.Generator().manual_seed(k)
        for p in m.parameters():
            p.grad = torch.randn(p.shape, generator=g)

    for k in range(2):
        grads(model, k)
        old.step()
    sd = old.state_dict()
    resumed_model = get_model("gpt")
    resumed_model.load_state_dict(model.state_dict())
    new = geomopt.GeomOptimizer(resumed_model, "muon")
    with pytest.raises(ValueError, match="allow_spec_change"):
        new.load_state_dict(sd)
    new.load_state_dict(sd, allow_spec_change=True)
    assert [g["step"] for g in new.param_groups] == [2] * len(new.param_groups)
    for k in range(2, 4):
        for m, o in ((model, old), (resumed_model, new)):
            grads(m, k)
            o.step()
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())
    for (n, a), b in zip(model.named_parameters(), resumed_model.parameters()):
        assert torch.equal(a, b), n
