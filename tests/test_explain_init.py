"""``geomopt explain`` (why a tensor gets its update), ``geomopt init`` (a starter spec from roles)
and ``geomopt rule roles|views``, on built-in models and a Hugging Face MoE model from its config."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

import geomopt
from geomopt.cli.main import main
from geomopt.compile import lint_spec
from geomopt.compile.compiler import model_params
from geomopt.compile.explain import RECIPES
from geomopt.models import MODELS

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
MUON = str(Path(__file__).resolve().parents[1] / "geomopt" / "specs" / "muon.yaml")

MOE_FACTORY = textwrap.dedent('''
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    def build():
        torch.manual_seed(0)
        return MixtralForCausalLM(MixtralConfig(
            vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2))
''')


@pytest.fixture
def moe_module(tmp_path, monkeypatch):
    (tmp_path / "moe_factory.py").write_text(MOE_FACTORY)
    monkeypatch.chdir(tmp_path)
    return "moe_factory:build"


def _run(capsys, *argv) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_explain_says_role_rules_view_ops_and_radius(capsys):
    rc, out, _ = _run(capsys, "explain", "uscion", "transformer.h.0.attn.c_attn.weight", "--model", "gpt")
    assert rc == 0
    assert "role       hidden" in out
    assert "1. embeddings" in out and "no: role hidden not in ['embedding']" in out
    assert "3. hidden" in out and "yes: owns it" in out
    assert "4. rest" in out and "came first" in out
    assert "view       3 × 64×64" in out  # fused q, k, v read as three blocks
    assert "newton_schulz" in out and "scale scion" in out
    assert "radius     1 " in out  # √(64/64) per block


def test_explain_an_expert_of_a_moe_model(capsys, moe_module):
    rc, out, _ = _run(capsys, "explain", MUON, "model.layers.0.mlp.experts.gate_up_proj", "--model", moe_module)
    assert rc == 0
    assert "role       expert" in out and "4 experts" in out
    assert "view       8 × 48×32" in out  # 4 experts × (gate, up), each 48×32
    rc, out, _ = _run(capsys, "explain", MUON, "model.layers.0.mlp.gate.weight", "--model", moe_module)
    assert "role       router" in out and "2. head" in out and "yes: owns it" in out
    assert "forward    adam" in out


def test_explain_unknown_parameter_is_a_usage_error(capsys):
    rc, _, err = _run(capsys, "explain", "muon", "transformer.h.0.attn.c_atn.weight", "--model", "gpt")
    assert rc == 2 and "no parameter 'transformer.h.0.attn.c_atn.weight'" in err
    assert "did you mean 'transformer.h.0.attn.c_attn.weight'" in err and "Traceback" not in err


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("model", ["gpt", "mlp", "cnn"])
def test_init_writes_a_spec_that_lints_clean(tmp_path, capsys, recipe, model):
    out = tmp_path / "spec.yaml"
    rc, _, err = _run(capsys, "init", "--model", model, "--recipe", recipe, "-o", str(out))
    assert rc == 0 and "wrote" in err
    spec = geomopt.load_spec(out)
    diags = lint_spec(spec, model_params(MODELS[model]())[0])
    assert [d.format() for d in diags if d.severity != "note"] == []
    assert "GO113" not in {d.code for d in diags}  # no idle role rules: init dropped them
    text = out.read_text()
    assert text.startswith("# Starter spec") and "Roles in this model:" in text
    rc, _, err = _run(capsys, "init", "--model", model, "--recipe", recipe, "-o", str(out))
    assert rc == 2 and "--force" in err


def test_init_on_a_moe_model_keeps_router_and_expert_rules(tmp_path, capsys, moe_module):
    rc, out, err = _run(capsys, "init", "--model", moe_module, "--recipe", "muon")
    assert rc == 0, err
    spec = geomopt.parse_spec(out, "yaml")
    assert [r.name for r in spec.rules] == ["embeddings", "head", "hidden", "rest"]
    rc, _, err = _run(capsys, "init", "--model", moe_module, "--recipe", "muonn")
    assert rc == 2 and "did you mean 'muon'" in err


def test_rule_documents_roles_and_views(capsys):
    rc, out, _ = _run(capsys, "rule", "roles")
    assert rc == 0
    for role in ("embedding", "head", "router", "expert", "norm", "bias", "hidden"):
        assert f"``{role}``" in out
    assert "get_output_embeddings" in out and "guess" in out
    rc, out, _ = _run(capsys, "rule", "views")
    assert rc == 0 and "batch" in out and "blocks" in out and "trailing" in out
