"""compile_spec: every shipped spec on every reference model (and Hugging Face GPT-2 where
installed); values resolved into ParamPlan; Plan.table(); buckets; compile-time errors."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import pydantic
import pytest
import torch
from torch import nn

import geomopt
from geomopt.compile import as_spec, compile_spec
from geomopt.compile.fragments import plain
from geomopt.lint import lint_spec
from geomopt.compile.params import params_from_model
from geomopt.support import supported_constraints
from geomopt.models import MODELS

ROOT = Path(__file__).resolve().parents[1]
SPECS = sorted([*(ROOT / "specs").glob("*.yaml"), *(ROOT / "specs").glob("*.geom")])  # YAML and DSL


@pytest.fixture(scope="module")
def models():
    built = {}
    for name, factory in MODELS.items():
        if name.startswith("gpt2-"):
            # 124M–774M parameters: names and shapes are all compile and lint need (built for
            # real, medium and large took ~20 s and ~4.5 GB here)
            with torch.device("meta"):
                built[name] = factory()
        else:
            built[name] = factory()
    return built


def test_specs_are_shipped():
    assert len(SPECS) >= 10


@pytest.mark.parametrize("spec_path", SPECS, ids=lambda p: p.name)
def test_every_shipped_spec_compiles_on_every_reference_model(spec_path, models):
    spec = geomopt.load_spec(spec_path)
    for name, model in models.items():
        plan = compile_spec(spec, model)
        assert {p.name for p in plan} == {n for n, _ in model.named_parameters()}, name
        errors = [d for d in lint_spec(spec, params_from_model(model)[0]) if d.severity == "error"]
        assert errors == [], name
        for p in plan:
            assert p.radius > 0 and math.isfinite(p.radius)
            assert p.rule == spec.rules[p.rule_index].name


# ---------------------------------------------------------------- Hugging Face GPT-2


@pytest.fixture(scope="module")
def hf_gpt2():
    import transformers  # a test dependency: CI installs it (about 16 s)

    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64)
    return transformers.GPT2LMHeadModel(config)


@pytest.mark.parametrize("spec_path", SPECS, ids=lambda p: p.name)
def test_shipped_specs_compile_on_hugging_face_gpt2(spec_path, hf_gpt2):
    spec = geomopt.load_spec(spec_path)
    plan = compile_spec(spec, hf_gpt2)
    assert [d for d in lint_spec(spec, params_from_model(hf_gpt2)[0]) if d.severity == "error"] == []
    # GPT-2 ties lm_head to wte: one plan, both names
    assert plan["lm_head.weight"] is plan["transformer.wte.weight"]
    conv1d = {f"{m}.weight" for m, mod in hf_gpt2.named_modules() if type(mod).__name__ == "Conv1D"}
    assert len(conv1d) == 8
    for p in plan:
        geometry = spec.rules[p.rule_index].geometry
        if p.name in conv1d and getattr(geometry, "layout", None) == "auto":
            assert p.transpose and p.op_shape == (p.shape[1], p.shape[0])


def test_hugging_face_conv1d_gets_the_true_scion_radius(hf_gpt2):
    plan = compile_spec(ROOT / "specs" / "scion.yaml", hf_gpt2)
    for layer in range(2):
        for suffix in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
            p = plan[f"transformer.h.{layer}.{suffix}.weight"]
            d_in, d_out = p.shape  # Conv1D stores (d_in, d_out)
            if suffix == "attn.c_attn":  # fused q, k, v: the auto view reads three (64, 64) blocks
                d_out //= 3
                assert p.geometry.view.blocks == (64, 64, 64)
            assert p.rule == "hidden" and p.transpose
            assert p.radius == pytest.approx(math.sqrt(d_out / d_in))
    assert plan["transformer.h.0.attn.c_attn.weight"].radius == pytest.approx(1.0)  # 64 / 64 per block
    assert plan["transformer.h.0.mlp.c_proj.weight"].radius == pytest.approx(0.5)  # 64 / 256
    # the nanoGPT reference model stores the same weights as (d_out, d_in): same radii, no transpose
    ours = compile_spec(ROOT / "specs" / "scion.yaml", MODELS["gpt"]())
    for p in plan:
        if p.rule == "hidden":
            assert ours[p.name].radius == pytest.approx(p.radius) and not ours[p.name].transpose


# ---------------------------------------------------------------- resolved values


def _spec(rules, defaults=None):
    return as_spec({"geomopt": 1, "name": "t", "defaults": defaults or {}, "rules": rules})


SPECTRAL = {"kind": "spectral", "reference": {"kind": "indicator"}, "approx": {"kind": "newton_schulz", "steps": 5}}
ISO = {"kind": "isotropic", "reference": {"kind": "log_barrier", "eps": 1e-8}}


def test_hyper_parameters_resolve_rule_over_defaults_over_builtins():
    spec = _spec(
        [
            {"name": "hidden", "match": {"name": "**.weight", "ndim": 2}, "geometry": SPECTRAL, "lr": 0.1,
             "direction": {"kind": "none"}, "weight_decay": 0.0, "on_nonfinite": "raise"},
            {"name": "rest", "match": "**", "geometry": ISO},
        ],
        defaults={"lr": 0.05, "weight_decay": 0.01, "direction": {"kind": "polyak", "alpha": 0.2},
                  "project_on_init": False},
    )
    plan = compile_spec(spec, nn.Linear(4, 3))
    w, b = plan["weight"], plan["bias"]
    assert (w.lr, w.weight_decay, plain(w.direction), w.on_nonfinite) == (0.1, 0.0, {"kind": "none"}, "raise")
    assert (b.lr, b.weight_decay, b.on_nonfinite) == (0.05, 0.01, "skip")
    assert plain(b.direction) == {"kind": "polyak", "alpha": 0.2, "nesterov": False, "init": "zero",
                           "warmup_steps": 0, "warmup_alpha": None}
    assert w.project_on_init is False and b.project_on_init is False
    assert plain(w.schedule) == plain(b.schedule) == {"kind": "constant"}


def test_builtin_defaults():
    plan = compile_spec(_spec([{"name": "all", "match": "**", "geometry": {"kind": "euclidean"}}]), nn.Linear(2, 2))
    p = plan["weight"]
    assert (p.lr, p.weight_decay, plain(p.direction), plain(p.schedule)) == (0.02, 0.0, {"kind": "none"}, {"kind": "constant"})
    assert (p.on_nonfinite, p.project_on_init, p.constraint) == ("skip", True, None)


def _fan(shape):
    return shape[0], math.prod(shape[1:])


# (geometry, tensor shape, expected radius multiplier of the preset) — formulas from geomopt.geometry.scale / Scion
SCALE_ROWS = [
    ({**SPECTRAL, "scale": "scion"}, (192, 64), math.sqrt(192 / 64)),
    ({**SPECTRAL, "scale": "scion"}, (64, 256), math.sqrt(64 / 256)),
    ({**SPECTRAL, "scale": "scion"}, (16, 4, 3, 3), math.sqrt(16 / 36)),  # conv: d_in = prod(rest)
    ({**SPECTRAL, "scale": "scion", "view": {"kind": "matrix", "blocks": 3}}, (192, 64), 1.0),  # one block of a fused QKV
    ({**SPECTRAL, "scale": "scion", "view": {"kind": "matrix", "batch": 1}}, (4, 128, 32), 2.0),  # one expert
    ({**SPECTRAL, "scale": "muon_original"}, (256, 64), 2.0),
    ({**SPECTRAL, "scale": "muon_original"}, (64, 256), 1.0),
    ({**SPECTRAL, "scale": "match_rms_adamw"}, (64, 256), 0.2 * 16),
    ({**SPECTRAL, "scale": "none"}, (64, 256), 1.0),
    ({"kind": "anisotropic", "reference": {"kind": "indicator"}, "scale": "scion"}, (10, 40), 1 / 40),
    ({**ISO, "scale": "scion"}, (7, 3), math.sqrt(21)),
    ({"kind": "rowwise", "reference": {"kind": "log_barrier"}, "scale": "scion"}, (8, 32), 1 / math.sqrt(32)),
    ({"kind": "columnwise", "reference": {"kind": "log_barrier"}, "scale": "scion"}, (8, 32), math.sqrt(8)),
    # in_out: ops see the transpose (32, 8); Scion's ColNorm(transpose=True) of an embedding is √dim
    ({"kind": "columnwise", "reference": {"kind": "log_barrier"}, "scale": "scion", "layout": "in_out"},
     (32, 8), math.sqrt(8)),
    ({"kind": "adam"}, (8, 32), 1.0),
    ({"kind": "euclidean"}, (8, 32), 1.0),
]


@pytest.mark.parametrize("geometry, shape, multiplier", SCALE_ROWS)
def test_radius_is_radius_times_scale_preset(geometry, shape, multiplier):
    spec = _spec([{"name": "all", "match": "**", "geometry": {**geometry, "radius": 2.5}}])
    plan = compile_spec(spec, [("w", nn.Parameter(torch.empty(shape, device="meta")))])
    p = plan["w"]
    assert p.radius == pytest.approx(2.5 * multiplier)
    assert p.geometry["radius"] == 2.5  # the declared radius stays in the geometry


def test_layout_in_out_transposes_and_auto_follows_the_module():
    emb = nn.Embedding(32, 8)
    col = {"kind": "columnwise", "reference": {"kind": "log_barrier"}}
    plan = compile_spec(_spec([{"name": "e", "match": "**", "geometry": {**col, "layout": "in_out"}}]), emb)
    p = plan["weight"]
    assert p.transpose and p.op_shape == (8, 32) and p.shape == (32, 8)
    assert p.geometry["layout"] == "out_in"  # the ops see the transposed tensor
    plan = compile_spec(_spec([{"name": "e", "match": "**", "geometry": col}]), emb)  # auto: not Conv1D
    assert not plan["weight"].transpose and plan["weight"].op_shape == (32, 8)


def test_relative_constraint_radius_is_in_units_of_the_resolved_radius():
    spec = _spec([
        {"name": "hidden", "match": {"ndim": 2}, "geometry": {**SPECTRAL, "scale": "scion", "radius": 2.0},
         "constraint": {"kind": "frobenius_ball", "radius": 0.5, "relative": True}},
        {"name": "fixed", "match": {"ndim": 1}, "geometry": ISO,
         "constraint": {"kind": "l2_ball", "radius": 0.5}},
    ])
    plan = compile_spec(spec, nn.Linear(64, 192))
    w = plan["weight"]
    assert w.radius == pytest.approx(2.0 * math.sqrt(3))
    assert plain(w.constraint) == {"kind": "frobenius_ball", "radius": pytest.approx(0.5 * w.radius), "relative": False}
    assert plain(plan["bias"].constraint) == {"kind": "l2_ball", "radius": 0.5, "relative": False}


@pytest.mark.parametrize("approx, explicit, expected", [
    ({"kind": "newton_schulz"}, None, {"kind": "frobenius", "eps": 1e-7}),
    ({"kind": "polar_express"}, None, {"kind": "frobenius", "eps": 1e-7}),
    ({"kind": "svd"}, None, {"kind": "none"}),
    ({"kind": "gram_eigh"}, None, {"kind": "none"}),
    ({"kind": "newton_schulz"}, {"kind": "max", "eps": 1e-6}, {"kind": "max", "eps": 1e-6}),
    ({"kind": "svd"}, {"kind": "frobenius", "eps": 1e-5}, {"kind": "frobenius", "eps": 1e-5}),
    ({"kind": "svd"}, {"kind": "none"}, {"kind": "none"}),
])
def test_prenormalize_defaults_on_for_iterative_approximations(approx, explicit, expected):
    geometry = {"kind": "spectral", "reference": {"kind": "indicator"}, "approx": approx}
    if explicit is not None:
        geometry["prenormalize"] = explicit
    plan = compile_spec(_spec([{"name": "all", "match": "**", "geometry": geometry}]), nn.Linear(4, 4, bias=False))
    assert plain(plan["weight"].geometry["prenormalize"]) == expected
    assert plan["weight"].geometry.approx_kind == approx["kind"]


def test_plans_share_only_frozen_fragments():
    plan = compile_spec(_spec([{"name": "all", "match": "**", "geometry": SPECTRAL,
                                "constraint": {"kind": "spectral_ball", "radius": 1.0}}]),
                        nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)))
    a, b = plan["0.weight"], plan["1.weight"]
    assert a.geometry == b.geometry and a.constraint == b.constraint and a.bucket == b.bucket
    # what two plans share cannot be changed through either
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.geometry.spec = b.geometry.spec  # type: ignore[misc]
    with pytest.raises(pydantic.ValidationError):
        a.geometry.approx.steps = 1  # type: ignore[union-attr]
    with pytest.raises(pydantic.ValidationError):
        a.constraint.radius = 2.0  # type: ignore[union-attr]
    with pytest.raises(TypeError):
        a.geometry["radius"] = 2.0  # type: ignore[index]


# ---------------------------------------------------------------- buckets and the table


def test_buckets_group_same_rule_ops_shape_dtype():
    model = nn.ModuleDict(dict(a=nn.Linear(8, 8), b=nn.Linear(8, 8), c=nn.Linear(8, 16), d=nn.Linear(8, 8).double(),
                               e=nn.Linear(8, 8)))
    spec = _spec([
        {"name": "e", "match": "e.weight", "geometry": SPECTRAL},  # same ops as `hidden`, another rule
        {"name": "hidden", "match": {"name": "**.weight", "ndim": 2}, "geometry": SPECTRAL},
        {"name": "rest", "match": "**", "geometry": ISO},
    ])
    plan = compile_spec(spec, model)
    buckets = {k: sorted(p.name for p in v) for k, v in plan.buckets().items()}
    groups = sorted(buckets.values())
    assert ["a.weight", "b.weight"] in groups
    assert ["c.weight"] in groups and ["d.weight"] in groups and ["e.weight"] in groups
    assert ["a.bias", "b.bias", "e.bias"] in groups  # (8,) float32 under `rest`
    assert ["c.bias"] in groups and ["d.bias"] in groups
    assert sum(map(len, groups)) == len(plan) == 10
    for key, members in plan.buckets().items():
        assert {(p.rule_index, p.op_shape, p.dtype, p.device, p.radius, p.transpose) for p in members} == {
            (members[0].rule_index, members[0].op_shape, members[0].dtype, members[0].device,
             members[0].radius, members[0].transpose)}


def test_relative_constraints_split_buckets_by_resolved_radius():
    spec = _spec([{"name": "all", "match": {"ndim": 2}, "geometry": {**SPECTRAL, "scale": "scion"},
                   "constraint": {"kind": "spectral_ball", "radius": 1.0, "relative": True}}])
    named = [("a", nn.Parameter(torch.empty(8, 8))), ("b", nn.Parameter(torch.empty(8, 8))),
             ("c", nn.Parameter(torch.empty(8, 32)))]
    plan = compile_spec(spec, named)
    assert plan["a"].bucket == plan["b"].bucket != plan["c"].bucket
    assert plan["c"].constraint["radius"] == pytest.approx(0.5)


def test_table_has_one_line_per_tensor_and_a_summary():
    model = MODELS["gpt"]()
    model.transformer.wpe.weight.requires_grad_(False)
    plan = compile_spec(ROOT / "specs" / "uscion.yaml", model)
    lines = plan.table().splitlines()
    header = lines[0].split()
    assert header == ["parameter", "shape", "role", "rule", "geometry", "view", "constraint", "lr", "radius", "bucket"]
    assert set(lines[1]) <= {"-", " "}
    body = lines[2:-1]
    assert len(body) == len(plan)
    bucket_ids = {key: i for i, key in enumerate(plan.buckets())}
    for line, p in zip(body, plan):
        assert line.startswith(p.name + " ")
        assert f" {p.rule} " in line and "×".join(map(str, p.shape)) in line and f" {p.role} " in line
        assert re.search(rf"\s{bucket_ids[p.bucket]}$", line)
        assert (" ᵀ" in line) == p.transpose
    wte = next(line for line in body if line.startswith("transformer.wte.weight"))
    assert "columnwise" in wte and " 8 ᵀ " in wte
    assert lines[-1] == f"{len(plan)} tensors in {len(bucket_ids)} buckets; 1 frozen (skipped): transformer.wpe.weight"


def test_table_shows_aliases_and_constraints():
    model = MODELS["gpt"]()
    model.lm_head.weight = model.transformer.wte.weight
    plan = compile_spec(ROOT / "specs" / "spectral-clip.yaml", model)
    text = plan.table()
    assert "transformer.wte.weight (= lm_head.weight)" in text
    assert "spectral_ball(radius=" in text and "relative" not in text.split("\n")[2]
    assert len(plan) == 28


def test_summary_counts_tensors_and_elements_per_rule():
    model = MODELS["mlp"]()
    plan = compile_spec(ROOT / "specs" / "uscion.yaml", model)
    rows = {r["rule"]: r for r in plan.summary()}
    assert sum(r["tensors"] for r in rows.values()) == len(plan)
    assert sum(r["elements"] for r in rows.values()) == sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------- errors


def _codes(exc) -> list[str]:
    return [d.code for d in exc.value.diagnostics]


def test_unmatched_parameters_raise_with_names_and_nearest_patterns():
    spec = _spec([{"name": "hidden", "match": "layers.*.weight", "geometry": SPECTRAL}])
    with pytest.raises(geomopt.SpecError) as exc:
        compile_spec(spec, MODELS["mlp"]())
    assert set(_codes(exc)) == {"GO101"}
    unmatched = ["layers.0.bias", "layers.1.bias", "head.weight", "head.bias"]
    assert len(exc.value.diagnostics) == len(unmatched)
    text = str(exc.value)
    for name in unmatched:
        assert f"'{name}'" in text
    assert "nearest patterns: 'layers.*.weight'" in text
    for d in exc.value.diagnostics:
        assert d.severity == "error" and d.line >= 1 and d.col >= 1


@pytest.mark.parametrize("geometry, constraint", [
    ("spectral", {"kind": "l0", "k": 3}),
    ("spectral", {"kind": "linf_ball", "radius": 1.0}),
    ("rowwise", {"kind": "stiefel", "radius": 1.0}),
    ("anisotropic", {"kind": "rank", "k": 2}),
    ("adam", {"kind": "l2_ball", "radius": 1.0}),
])
def test_pair_without_operator_names_the_supported_pairs(geometry, constraint):
    g = {"kind": geometry} if geometry == "adam" else {"kind": geometry, "reference": {"kind": "indicator"}}
    spec = _spec([{"name": "all", "match": "**", "geometry": g, "constraint": constraint}])
    with pytest.raises(geomopt.SpecError) as exc:
        compile_spec(spec, nn.Linear(4, 4, bias=False))
    assert _codes(exc) == ["GO105"]
    message = exc.value.diagnostics[0].message
    assert f"{geometry} geometry with {constraint['kind']} constraint" in message
    supported = supported_constraints(geometry)
    assert constraint["kind"] not in supported
    for kind in supported:
        assert kind in message
    if not supported:
        assert "no constraints" in message


def test_spectral_on_a_vector_is_an_error():
    spec = _spec([{"name": "all", "match": "**", "geometry": SPECTRAL}])
    with pytest.raises(geomopt.SpecError) as exc:
        compile_spec(spec, nn.Linear(4, 3))
    assert _codes(exc) == ["GO104"]
    assert "'bias'" in str(exc.value) and "at least 2 dimensions" in str(exc.value)


def test_view_blocks_must_divide_the_rows():
    spec = _spec([{"name": "all", "match": "**", "geometry": {**SPECTRAL, "view": {"kind": "matrix", "blocks": 5}}}])
    with pytest.raises(geomopt.SpecError) as exc:
        compile_spec(spec, nn.Linear(64, 192, bias=False))
    assert _codes(exc) == ["GO104"]
    assert "blocks=5" in str(exc.value) and "[2, 3, 4, 6, 8, 12]" in str(exc.value) and "'weight' (192×64)" in str(exc.value)
    ok = compile_spec(_spec([{"name": "all", "match": "**", "geometry": {**SPECTRAL, "view": {"kind": "matrix", "blocks": 3}}}]),
                      nn.Linear(64, 192, bias=False))
    assert ok["weight"].geometry.view.blocks == (64, 64, 64)


def test_view_unequal_blocks_carry_radius_factors():
    """Fused q, k, v under grouped-query attention (64 + 16 + 16 rows): the plan's radius is the
    q block's, the k and v blocks carry √(16/64) relative to it under ``scale: scion``."""
    view = {"kind": "matrix", "blocks": [64, 16, 16]}
    plan = compile_spec(_spec([{"name": "all", "match": "**", "geometry": {**SPECTRAL, "scale": "scion", "view": view},
                                "constraint": {"kind": "spectral_ball", "radius": 1.0, "relative": True}}]),
                        nn.Linear(64, 96, bias=False))
    pp = plan["weight"]
    assert pp.radius == pytest.approx(1.0)
    assert pp.geometry.view.factors == pytest.approx((1.0, 0.5, 0.5))
    assert pp.geometry.view.scale_constraint is True
    with pytest.raises(geomopt.SpecError, match="sum to 80"):
        compile_spec(_spec([{"name": "all", "match": "**", "geometry": {**SPECTRAL, "view": {"kind": "matrix", "blocks": [64, 16]}}}]),
                     nn.Linear(64, 96, bias=False))


def test_every_blocking_finding_is_reported_at_once():
    spec = _spec([
        {"name": "hidden", "match": "**.weight", "geometry": SPECTRAL, "constraint": {"kind": "l0", "k": 1}},
        {"name": "vec", "match": "0.bias", "geometry": SPECTRAL},
    ])
    with pytest.raises(geomopt.SpecError) as exc:
        compile_spec(spec, nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    assert sorted(_codes(exc)) == ["GO101", "GO104", "GO105"]


# ---------------------------------------------------------------- inputs


def test_compile_from_a_path_a_dict_and_a_spec_agree():
    model = MODELS["gpt"]()
    path = ROOT / "specs" / "prox-muon-frobenius.yaml"
    spec = geomopt.load_spec(path)
    plans = [compile_spec(s, model) for s in (path, str(path), spec.model_dump(), spec)]
    for plan in plans[1:]:
        assert plan.params == plans[0].params
        assert [p.bucket for p in plan] == [p.bucket for p in plans[0]]
    assert plans[0].spec_name == "prox-muon-frobenius"


def test_compile_from_a_bad_dict_raises_spec_error():
    with pytest.raises(geomopt.SpecError) as exc:
        compile_spec({"geomopt": 1, "name": "t", "rules": [{"name": "a", "match": "**"}]}, nn.Linear(2, 2))
    assert "GO006" in _codes(exc)


def test_compile_rejects_what_is_not_a_spec():
    with pytest.raises(TypeError, match="spec must be"):
        compile_spec(3, nn.Linear(2, 2))


def test_iterable_of_name_tensor_pairs():
    model = MODELS["gpt"]()
    spec = geomopt.load_spec(ROOT / "specs" / "normalized-sgd.yaml")
    from_module = compile_spec(spec, model)
    from_pairs = compile_spec(spec, model.named_parameters())  # a generator
    assert from_pairs.params == from_module.params
    meta = [(f"blocks.{i}.w", torch.empty(4, 4, device="meta")) for i in range(3)]
    plan = compile_spec(spec, iter(meta))
    assert [(p.name, p.shape, p.device) for p in plan] == [(f"blocks.{i}.w", (4, 4), "meta") for i in range(3)]


def test_compile_rejects_pairs_that_are_not_tensors():
    spec = geomopt.load_spec(ROOT / "specs" / "normalized-sgd.yaml")
    with pytest.raises(TypeError, match="not a torch.Tensor"):
        compile_spec(spec, [("a", [1.0, 2.0])])
    with pytest.raises(TypeError, match="iterable of \\(name, tensor\\)"):
        compile_spec(spec, 42)
