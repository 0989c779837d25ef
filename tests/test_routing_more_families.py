"""Routing tables, tensor by tensor, for five more transformers 5 families built from tiny configs
(random init, no download): BART (an encoder-decoder: the decoder's cross-attention reads the
encoder's states, the token table tied to the LM head), GPT-NeoX (q, k, v fused and interleaved
per head), Hiera (a hierarchical vision transformer: masked-unit windows, pooled queries, a wider
stage reached through a projection), ConvNeXt (depthwise 7×7 convolutions, per-channel layer-scale
gammas, 2×2 strided downsampling) and Swin (an indexed relative-position bias table, a
shifted-window block).

Each role and each hidden matrix's view is written by hand, with its reason where it is not
obvious, and checked through the oracle of ``test_routing_views`` (no wrong-spectral tensor, none
missed) under every shipped spectral spec; every tensor is traced, every shipped spec lints clean
and the optimizer builds without a ``RolesGuessedWarning``.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

import geomopt
from geomopt.compile import compile_spec

from test_routing import ALL_SPECS, SPECTRAL, SPECTRAL_SPECS, _layers, spec_findings, transformers_builds
from test_routing_views import _LN, _under, assert_traced_roles, misrouted

ROOT = Path(__file__).resolve().parents[1]

BUILDERS = {
    "bart": lambda t: t.BartForConditionalGeneration(t.BartConfig(
        vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=16)),
    "gpt-neox": lambda t: t.GPTNeoXForCausalLM(t.GPTNeoXConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=16)),
    # two stages: 16 × 16 tokens in 4 × 4 masked units, then queries pooled 2 × 2 into a 16-wide stage
    "hiera": lambda t: t.HieraForImageClassification(t.HieraConfig(
        embed_dim=8, image_size=[32, 32], patch_size=[3, 3], patch_stride=[2, 2], patch_padding=[1, 1],
        depths=[1, 1], num_heads=[1, 2], num_query_pool=1, query_stride=[2, 2], masked_unit_size=[4, 4],
        masked_unit_attention=[True, False], num_labels=3)),
    "convnext": lambda t: t.ConvNextForImageClassification(t.ConvNextConfig(
        hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, image_size=32, num_labels=3)),
    # stage 0 on an 8 × 8 map in 4 × 4 windows: its second block shifts them (torch.roll, masked scores)
    "swin": lambda t: t.SwinForImageClassification(t.SwinConfig(
        image_size=32, patch_size=4, embed_dim=8, depths=[2, 1], num_heads=[1, 2], window_size=4, num_labels=3)),
}
ARCHS = list(BUILDERS)


build = transformers_builds(BUILDERS)


def _linear(name: str) -> dict:
    return {f"{name}.weight": "hidden", f"{name}.bias": "bias"}


def _hidden(roles: dict, shapes: dict) -> dict:
    """The view of every hidden matrix of ``roles``, from ``shapes``: layer (its name's two dotted
    parts before ``weight``) → view, where the same layer has the same view in every block."""
    return {name: shapes[".".join(name.split(".")[-3:-1])] for name, role in roles.items()
            if set(role.split("+")) & SPECTRAL}


ROLES: dict[str, dict[str, str]] = {}
VIEWS: dict[str, dict[str, str]] = {}

# ---------------------------------------------------------------- BART
_BART_ATTN = {**_linear("q_proj"), **_linear("k_proj"), **_linear("v_proj"), **_linear("out_proj")}
_BART_FFN = {**_linear("fc1"), **_linear("fc2"), **_under("final_layer_norm", _LN)}
ROLES["bart"] = {
    "model.shared.weight": "embedding+head",  # the token table of both sides, tied to the LM head
    # learned positions (2 + 16 rows: BART's offset of 2), looked up by position
    "model.encoder.embed_positions.weight": "embedding", "model.decoder.embed_positions.weight": "embedding",
    **_under("model.encoder.layernorm_embedding", _LN), **_under("model.decoder.layernorm_embedding", _LN),
    **_under("model.encoder.layers.0.self_attn", _BART_ATTN),
    **_under("model.encoder.layers.0.self_attn_layer_norm", _LN), **_under("model.encoder.layers.0", _BART_FFN),
    **_under("model.decoder.layers.0.self_attn", _BART_ATTN),
    **_under("model.decoder.layers.0.self_attn_layer_norm", _LN),
    # cross-attention: q from the decoder, k and v from the encoder's output; four separate matrices
    **_under("model.decoder.layers.0.encoder_attn", _BART_ATTN),
    **_under("model.decoder.layers.0.encoder_attn_layer_norm", _LN), **_under("model.decoder.layers.0", _BART_FFN),
}
VIEWS["bart"] = _hidden(ROLES["bart"], {"self_attn.q_proj": "32×32", "self_attn.k_proj": "32×32",
                                        "self_attn.v_proj": "32×32", "self_attn.out_proj": "32×32",
                                        "encoder_attn.q_proj": "32×32", "encoder_attn.k_proj": "32×32",
                                        "encoder_attn.v_proj": "32×32", "encoder_attn.out_proj": "32×32",
                                        "0.fc1": "64×32", "0.fc2": "32×64"})

# ---------------------------------------------------------------- GPT-NeoX
_NEOX = "gpt_neox.layers.0."
ROLES["gpt-neox"] = {
    "gpt_neox.embed_in.weight": "embedding", "lm_head.weight": "head",
    **_under(_NEOX + "input_layernorm", _LN), **_under(_NEOX + "post_attention_layernorm", _LN),
    # q, k, v fused, its output viewed (…, heads 4, 3·8) and chunked: rows [q₀ k₀ v₀ q₁ k₁ v₁ …]
    **_linear(_NEOX + "attention.query_key_value"), **_linear(_NEOX + "attention.dense"),
    **_linear(_NEOX + "mlp.dense_h_to_4h"), **_linear(_NEOX + "mlp.dense_4h_to_h"),
    **_under("gpt_neox.final_layer_norm", _LN),
}
VIEWS["gpt-neox"] = _hidden(ROLES["gpt-neox"], {
    # what the forward multiplies by: q, k and v, each 32 × 32 (4 heads' 8 rows, strided in storage)
    "attention.query_key_value": "3 × 32×32",
    "attention.dense": "32×32", "mlp.dense_h_to_4h": "64×32", "mlp.dense_4h_to_h": "32×64"})

# ---------------------------------------------------------------- Hiera
_HIERA = {**_under("layernorm_before", _LN), **_linear("attn.qkv"), **_linear("attn.proj"),
          **_under("layernorm_after", _LN), **_linear("mlp.fc1"), **_linear("mlp.fc2")}
ROLES["hiera"] = {
    "hiera.embeddings.position_embeddings": "embedding",  # a (1, 256, 8) table added to the patches
    "hiera.embeddings.patch_embeddings.projection.weight": "embedding",  # the stem: a conv reading pixels
    "hiera.embeddings.patch_embeddings.projection.bias": "bias",
    **_layers("hiera.encoder.stages.{i}.layers.0.", 2, _HIERA),
    # the first layer of the wider stage projects the residual 8 → 16 before pooling it
    **_linear("hiera.encoder.stages.1.layers.0.proj"),
    **_under("hiera.pooler.layernorm", _LN), **_linear("classifier"), "classifier.weight": "head",
}
VIEWS["hiera"] = {
    # reshaped (…, windows, 3, heads, d) and unbound over the 3: contiguous q | k | v blocks
    "hiera.encoder.stages.0.layers.0.attn.qkv.weight": "3 × 8×8",
    "hiera.encoder.stages.0.layers.0.attn.proj.weight": "8×8",
    "hiera.encoder.stages.0.layers.0.mlp.fc1.weight": "32×8", "hiera.encoder.stages.0.layers.0.mlp.fc2.weight": "8×32",
    "hiera.encoder.stages.1.layers.0.attn.qkv.weight": "3 × 16×8",  # reads the 8-wide input, emits 16-wide heads
    "hiera.encoder.stages.1.layers.0.attn.proj.weight": "16×16",
    "hiera.encoder.stages.1.layers.0.mlp.fc1.weight": "64×16",
    "hiera.encoder.stages.1.layers.0.mlp.fc2.weight": "16×64", "hiera.encoder.stages.1.layers.0.proj.weight": "16×8"}

# ---------------------------------------------------------------- ConvNeXt
_CONVNEXT = {
    "layer_scale_parameter": "other",  # the layer-scale gamma: one factor per channel, multiplied in
    "dwconv.weight": "other", "dwconv.bias": "bias",  # depthwise 7×7 (C, 1, 7, 7), groups = C: C filters
    **_under("layernorm", _LN), **_linear("pwconv1"), **_linear("pwconv2"),  # pointwise: nn.Linear
}
ROLES["convnext"] = {
    "convnext.embeddings.patch_embeddings.weight": "embedding",  # the 4×4 stride-4 stem reading pixels
    "convnext.embeddings.patch_embeddings.bias": "bias", **_under("convnext.embeddings.layernorm", _LN),
    **_layers("convnext.encoder.stages.{i}.layers.0.", 2, _CONVNEXT),
    # downsampling: a channels-first LayerNorm, then a full 2×2 stride-2 conv (16, 8, 2, 2)
    **_under("convnext.encoder.stages.1.downsampling_layer.0", _LN),
    **_linear("convnext.encoder.stages.1.downsampling_layer.1"),
    **_under("convnext.layernorm", _LN), **_linear("classifier"), "classifier.weight": "head",
}
VIEWS["convnext"] = {
    "convnext.encoder.stages.0.layers.0.pwconv1.weight": "32×8",
    "convnext.encoder.stages.0.layers.0.pwconv2.weight": "8×32",
    "convnext.encoder.stages.1.layers.0.pwconv1.weight": "64×16",
    "convnext.encoder.stages.1.layers.0.pwconv2.weight": "16×64",
    "convnext.encoder.stages.1.downsampling_layer.1.weight": "16×32"}  # out × in·kh·kw, one matrix

# ---------------------------------------------------------------- Swin
_SWIN = {**_linear("attention.q_proj"), **_linear("attention.k_proj"), **_linear("attention.v_proj"),
         **_linear("attention.o_proj"),
         # (2·4 − 1)² rows × heads: rows gathered by relative offset, added to the scores; not a matrix
         "attention.relative_position_bias.relative_position_bias_table": "other",
         **_under("layernorm_before", _LN), **_under("layernorm_after", _LN), **_linear("mlp.fc1"),
         **_linear("mlp.fc2")}
ROLES["swin"] = {
    "swin.embeddings.patch_embeddings.projection.weight": "embedding",  # the patch stem
    "swin.embeddings.patch_embeddings.projection.bias": "bias", **_under("swin.embeddings.norm", _LN),
    **_layers("swin.encoder.layers.0.blocks.{i}.", 2, _SWIN), **_under("swin.encoder.layers.1.blocks.0", _SWIN),
    # patch merging: 2 × 2 neighbours concatenated (4·8 = 32), normalized, reduced to 16 (no bias)
    "swin.encoder.layers.0.downsample.reduction.weight": "hidden",
    **_under("swin.encoder.layers.0.downsample.norm", _LN),
    **_under("swin.layernorm", _LN), **_linear("classifier"), "classifier.weight": "head",
}
VIEWS["swin"] = {
    **{f"swin.encoder.layers.0.blocks.{i}.attention.{p}_proj.weight": "8×8" for i in (0, 1) for p in "qkvo"},
    **{f"swin.encoder.layers.0.blocks.{i}.mlp.{fc}.weight": v for i in (0, 1)
       for fc, v in (("fc1", "32×8"), ("fc2", "8×32"))},
    **{f"swin.encoder.layers.1.blocks.0.attention.{p}_proj.weight": "16×16" for p in "qkvo"},
    "swin.encoder.layers.1.blocks.0.mlp.fc1.weight": "64×16", "swin.encoder.layers.1.blocks.0.mlp.fc2.weight": "16×64",
    "swin.encoder.layers.0.downsample.reduction.weight": "16×32"}

# What the oracle still finds (wrong-spectral, missed-spectral), with the reason: no view reads
# rows interleaved per head (docs/guide/architectures.md), so GPT-NeoX's fused q, k, v is one
# 96 × 32 matrix (preset radius √3) where the forward multiplies by three 32 × 32 ones.
KNOWN = {"gpt-neox": (["gpt_neox.layers.0.attention.query_key_value.weight"], [])}


def test_tables_name_every_hidden_matrix_with_its_view():
    assert set(ROLES) == set(VIEWS) == set(ARCHS)
    for arch in ARCHS:
        hidden = {n for n, r in ROLES[arch].items() if set(r.split("+")) & SPECTRAL}
        assert set(VIEWS[arch]) == hidden, arch


@pytest.mark.parametrize("arch", ARCHS)
def test_traced_roles_match_the_table(arch):
    assert_traced_roles(build(arch), ROLES[arch])


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("spec_name", SPECTRAL_SPECS)
def test_no_wrong_or_missed_spectral(spec_name, arch):
    plan = compile_spec(ROOT / "specs" / f"{spec_name}.yaml", build(arch))
    assert misrouted(plan, ROLES[arch], VIEWS[arch]) == KNOWN.get(arch, ([], []))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("spec_name", ALL_SPECS)
def test_shipped_specs_lint_clean(spec_name, arch):
    assert spec_findings(spec_name, build(arch)) == []


@pytest.mark.parametrize("arch", ARCHS)
def test_the_optimizer_builds_on_traced_roles_without_a_warning(arch):
    with warnings.catch_warnings():
        warnings.simplefilter("error", geomopt.RolesGuessedWarning)
        geomopt.GeomOptimizer(build(arch), "muon")
