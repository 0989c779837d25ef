"""``geomopt explain`` (why a tensor gets its update), ``geomopt init`` (a starter spec from roles)
and ``geomopt rule roles|views``, on built-in models and a Hugging Face MoE model from its config."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

import geomopt
from geomopt.cli.main import main
from geomopt.lint import lint_spec
from geomopt.compile.compiler import model_params
from geomopt.compile.explain import RECIPES
from geomopt.models import MODELS

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
MUON = str(Path(__file__).resolve().parents[1] / "specs" / "muon.yaml")

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


def test_explain_says_which_factor_each_side_of_a_kronecker_rule_keeps(capsys, tmp_path):
    """Shampoo keeps a full factor or none past max_dim; PSGD a triangular one, or a diagonal past it."""
    spec = tmp_path / "k.yaml"
    for method, want in (("psgd", "factors    left diagonal of 256, right 64×64 triangular"),
                         ("shampoo", "factors    left none (identity; 256 > max_dim), right 64×64")):
        spec.write_text(f"geomopt: 1\nname: k\nrules:\n  - name: m\n    match: {{ndim: 2}}\n    geometry: "
                        f"{{kind: kronecker, method: {method}, max_dim: 100}}\n  - name: rest\n    match: '**'\n"
                        f"    geometry: {{kind: euclidean}}\n")
        rc, out, _ = _run(capsys, "explain", str(spec), "transformer.wte.weight", "--model", "gpt")
        assert rc == 0 and want in out, out
    # under a view, each matrix keeps its own: fused q, k, v as three blocks
    spec.write_text("geomopt: 1\nname: k\nrules:\n  - name: m\n    match: {ndim: 2}\n    geometry: "
                    "{kind: kronecker, view: auto}\n  - name: rest\n    match: '**'\n    geometry: {kind: euclidean}\n")
    rc, out, _ = _run(capsys, "explain", str(spec), "transformer.h.0.attn.c_attn.weight", "--model", "gpt")
    assert rc == 0 and "factors    3 matrices, each: left 64×64, right 64×64" in out, out


def test_explain_an_expert_of_a_moe_model(capsys, moe_module):
    rc, out, _ = _run(capsys, "explain", MUON, "model.layers.0.mlp.experts.gate_up_proj", "--model", moe_module)
    assert rc == 0
    assert "role       expert" in out and "4 experts" in out
    assert "view       8 × 48×32" in out  # 4 experts × (gate, up), each 48×32
    rc, out, _ = _run(capsys, "explain", MUON, "model.layers.0.mlp.gate.weight", "--model", moe_module)
    assert "role       router" in out and "3. head" in out and "yes: owns it" in out
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
    assert [r.name for r in spec.rules] == ["hidden", "embeddings", "head", "rest"]
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


# ---------------------------------------------------------------- roles from use in the CLI

SCAN_FACTORY = textwrap.dedent('''
    import torch
    from torch import nn

    class Scan(nn.Module):
        """A decay table used through exp (a matrix by its shape, elementwise by its use), a
        depthwise short convolution, a projection and a head; no example_inputs() of its own."""

        def __init__(self):
            super().__init__()
            self.A_log = nn.Parameter(torch.zeros(16, 4))
            self.conv = nn.Conv1d(16, 16, 3, padding=1, groups=16)
            self.proj = nn.Linear(16, 16)
            self.head = nn.Linear(16, 3)

        def forward(self, x):
            h = self.conv(x.transpose(1, 2)).transpose(1, 2)
            h = self.proj(h) * torch.exp(-self.A_log.exp()).sum(-1)
            return self.head(h.mean(1))

    def with_inputs():
        return Scan(), torch.zeros(1, 5, 16)

    def bare():
        return Scan()
''')


@pytest.fixture
def scan_module(tmp_path, monkeypatch):
    (tmp_path / "scan_factory.py").write_text(SCAN_FACTORY)
    monkeypatch.chdir(tmp_path)
    return "scan_factory"


def test_explain_shows_the_trace_and_the_module_tree(capsys, scan_module):
    rc, out, _ = _run(capsys, "explain", "muon", "A_log", "--model", f"{scan_module}:with_inputs")
    assert rc == 0
    assert "role       other (traced): used only elementwise (mul)" in out
    assert "the module tree said hidden" in out and "hidden" not in out.split("rules")[1].split("yes:")[1][:40]
    rc, out, _ = _run(capsys, "explain", "muon", "A_log", "--model", f"{scan_module}:bare")
    assert "role       hidden (inferred without a trace)" in out and "no trace: no example inputs" in out


def test_init_and_lint_follow_the_traced_roles(tmp_path, capsys, scan_module):
    out_file = tmp_path / "scan-muon.yaml"
    rc, _, err = _run(capsys, "init", "--model", f"{scan_module}:with_inputs", "--recipe", "muon", "-o", str(out_file))
    assert rc == 0, err
    rc, out, _ = _run(capsys, "lint", str(out_file), "--model", f"{scan_module}:with_inputs")
    assert rc == 0 and "GO125" in out and "'A_log' hidden → other" in out and "GO124" not in out
    rc, out, _ = _run(capsys, "plan", "muon", "--model", f"{scan_module}:with_inputs")
    rows = {line.split()[0]: line for line in out.splitlines() if line.strip() and line.split()[0] in (
        "A_log", "conv.weight", "proj.weight", "head.weight")}
    assert "spectral" in rows["proj.weight"] and "spectral" not in rows["A_log"]
    assert "spectral" not in rows["conv.weight"] and "spectral" not in rows["head.weight"]
    rc, out, _ = _run(capsys, "lint", "muon", "--model", f"{scan_module}:bare")
    assert rc == 0 and "GO124" in out and "no example inputs" in out


def test_plan_explain_init_and_lint_say_when_roles_had_no_trace(capsys, scan_module):
    bare, traced = f"{scan_module}:bare", f"{scan_module}:with_inputs"
    rc, out, err = _run(capsys, "plan", "muon", "--model", bare)
    assert rc == 0 and "GO124" in err and "no example inputs (Scan has no example_inputs() method" in err
    assert "A_log" in out  # the table still prints, on stdout
    rc, out, err = _run(capsys, "plan", "muon", "--model", traced)
    assert rc == 0 and "GO124" not in err
    rc, out, _ = _run(capsys, "init", "--model", bare, "--recipe", "muon")
    roles_line = next(line for line in out.splitlines() if line.startswith("# Roles in this model:"))
    assert "decided without a trace: no example inputs" in roles_line and "example_inputs=" in roles_line
    rc, out, _ = _run(capsys, "init", "--model", traced, "--recipe", "muon")
    assert "without a trace" not in out
    rc, out, _ = _run(capsys, "explain", "muon", "A_log", "--model", bare)
    assert "no trace: no example inputs" in out and "pin the roles with the spec's roles:" in out
    # GO124 stays a note (exit 0) unless the trace is required
    assert _run(capsys, "lint", "muon", "--model", bare)[0] == 0
    assert _run(capsys, "lint", "muon", "--model", bare, "--require-trace")[0] == 1
    assert _run(capsys, "lint", "muon", "--model", traced, "--require-trace")[0] == 0


def test_a_factory_returning_unusable_inputs_is_a_usage_error(tmp_path, capsys, monkeypatch):
    (tmp_path / "bad_factory.py").write_text("import torch\n\ndef build():\n    return torch.nn.Linear(2, 2), 3\n")
    monkeypatch.chdir(tmp_path)
    rc, _, err = _run(capsys, "lint", "muon", "--model", "bad_factory:build")
    assert rc == 2 and "Traceback" not in err and "--model bad_factory:build's inputs must be a tensor" in err
