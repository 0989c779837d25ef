"""Routing tables for Hugging Face model families whose forward the trace must first get to run: a
dual tower (SigLIP: text and image inputs together), a vision-language model that splices image
features into its text (LLaVA: as many placeholder tokens as the vision tower has patches; Gemma 3:
as many as its projector pools them to), an
audio encoder (Wav2Vec2: raw samples, a weight-normed grouped positional convolution), a detection
transformer (YOLOS: learned detection tokens, two prediction heads) and two CNNs with depthwise
convolutions (EfficientNet with squeeze-excitation, MobileNetV2), whose BatchNorm refuses a
batch of one on the final 1×1 map — transformers 5 models built from tiny configs, random init,
no download. Each table maps name patterns (first match wins) to the role the traced forward
gives; every tensor must be traced (no role decided from the module tree), every shipped spec
must lint clean, and the optimizer must build without a ``RolesGuessedWarning``.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import geomopt
from geomopt.compile import compile_spec
from geomopt.compile.compiler import model_params
from geomopt.compile.match import glob_regex
from geomopt.compile.trace.forward import trace_model
from geomopt.compile.trace.inputs import as_inputs, default_inputs
from geomopt.lint import lint_spec

from test_routing import ALL_SPECS, NOT_SPECTRAL, SPECTRAL, SPECTRAL_SPECS, transformers_builds

ROOT = Path(__file__).resolve().parents[1]

_TEXT = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8)
_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=16,
               patch_size=8)

BUILDERS = {
    "siglip": lambda t: t.SiglipModel(t.SiglipConfig(
        text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=16),
        vision_config=_VISION)),
    # the image placeholder inside the tiny vocabulary: 4 patches per image, so 4 placeholders
    "llava": lambda t: t.LlavaForConditionalGeneration(t.LlavaConfig(
        text_config=t.LlamaConfig(**_TEXT), vision_config=t.CLIPVisionConfig(**_VISION), image_token_id=60,
        projector_hidden_act="gelu", vision_feature_layer=-1)),
    # the projector pools the vision tower's 2 × 2 patches to mm_tokens_per_image = 4 placeholders
    "gemma3": lambda t: t.Gemma3ForConditionalGeneration(t.Gemma3Config(
        text_config=t.Gemma3TextConfig(**_TEXT), vision_config=t.SiglipVisionConfig(**_VISION), image_token_id=60,
        boi_token_index=61, eoi_token_index=62, mm_tokens_per_image=4)),
    "wav2vec2": lambda t: t.Wav2Vec2ForCTC(t.Wav2Vec2Config(
        vocab_size=16, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=8,
        num_conv_pos_embedding_groups=4)),
    "yolos": lambda t: t.YolosForObjectDetection(t.YolosConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=[16, 16],
        patch_size=8, num_detection_tokens=3, num_labels=3)),
    # 32-pixel images end on a 1×1 map under BatchNorm: a batch of one fails in training
    "efficientnet": lambda t: t.EfficientNetForImageClassification(t.EfficientNetConfig(
        image_size=32, width_coefficient=0.1, depth_coefficient=0.1, hidden_dim=128, num_labels=3)),
    "mobilenet-v2": lambda t: t.MobileNetV2ForImageClassification(t.MobileNetV2Config(
        image_size=32, depth_multiplier=0.25, num_labels=3)),
}
ARCHS = list(BUILDERS)

# a norm layer's weight and bias are norm; every other bias is bias
_NORMS_AND_BIASES = {"**norm*.*": "norm", "**.bias": "bias"}

# name pattern → role, first match wins; comments give the reason where the role is not obvious
ROLES = {
    "siglip": {
        "logit_scale": "other",
        "logit_bias": "bias",
        "vision_model.head.attention.in_proj_bias": "bias",
        "*_model.embeddings.*_embedding.weight": "embedding",  # token, position lookups; the patch stem
        # the pooled text state's projection: the last layer before logits_per_image / per_text
        "text_model.head.weight": "head",
        # the attention-pooling head's learned query (1, 1, 32) enters a matmul: one row, a vector
        "vision_model.head.probe": "other",
        "vision_model.head.mlp.fc2.weight": "head",  # the last layer of the pooling head
        "vision_model.head.attention.in_proj_weight": "hidden",
        **_NORMS_AND_BIASES,
        "**.weight": "hidden",
    },
    "llava": {
        "model.vision_tower.embeddings.class_embedding": "embedding",  # CLIP's class token, concatenated
        "model.vision_tower.embeddings.*.weight": "embedding",  # the patch stem reading pixels; positions
        "model.language_model.embed_tokens.weight": "embedding",
        "lm_head.weight": "head",
        # the projector maps image features into the text's width: a body matrix, traced through bmm
        "model.multi_modal_projector.linear_*.weight": "hidden",
        **_NORMS_AND_BIASES,
        "**.weight": "hidden",
    },
    "gemma3": {
        "model.vision_tower.embeddings.*.weight": "embedding",  # the patch stem; positions
        "model.language_model.embed_tokens.weight": "embedding+head",  # tied: looked up and the logits' layer
        "model.multi_modal_projector.mm_input_projection_weight": "hidden",  # a bare parameter, traced via bmm
        # SigLIP's pooling head runs, its output unused (the text reads the patches): a body like any
        "model.vision_tower.head.probe": "other",  # its learned query (1, 1, 32): one row
        "model.vision_tower.head.attention.in_proj_weight": "hidden",
        "model.vision_tower.head.attention.in_proj_bias": "bias",
        **_NORMS_AND_BIASES,
        "**.weight": "hidden",
    },
    "wav2vec2": {
        "wav2vec2.masked_spec_embed": "other",  # a vector written over masked frames (index_put_)
        "wav2vec2.feature_extractor.conv_layers.0.conv.weight": "embedding",  # an audio stem: reads samples
        # weight norm's g (1, 1, 8) and v of a grouped positional convolution: never a matrix
        "wav2vec2.encoder.pos_conv_embed.conv.parametrizations.weight.original?": "embedding",
        "lm_head.weight": "head",
        **_NORMS_AND_BIASES,
        "**.weight": "hidden",  # the second feature convolution (8, 8, 3) too: a full convolution
    },
    "yolos": {
        # class, detection tokens and positions concatenated or added to the patches
        "vit.embeddings.cls_token": "embedding",
        "vit.embeddings.detection_tokens": "embedding",
        "vit.embeddings.position_embeddings": "embedding",
        "vit.embeddings.patch_embeddings.projection.weight": "embedding",  # the patch stem
        "vit.encoder.interpolation.mid_position_embeddings": "embedding",  # zero-size: never read
        "class_labels_classifier.layers.2.weight": "head",  # → logits
        "bbox_predictor.layers.2.weight": "head",  # → pred_boxes
        **_NORMS_AND_BIASES,
        "**.weight": "hidden",  # the prediction MLPs' inner layers too
    },
    "efficientnet": {
        "efficientnet.embeddings.convolution.weight": "embedding",  # the stem reading pixels
        "**.depthwise_conv.depthwise_conv.weight": "other",  # (C, 1, k, k), groups = C: C separate filters
        "**_bn.*": "norm",  # BatchNorm: expand_bn, project_bn, top_bn
        **_NORMS_AND_BIASES,  # batchnorm, depthwise_norm
        "classifier.weight": "head",
        "**.weight": "hidden",  # expansion, squeeze-excitation reduce/expand and projection 1×1 kernels
    },
    "mobilenet-v2": {
        "**.conv_3x3.convolution.weight": "other",  # depthwise (C, 1, 3, 3), groups = C
        "**.normalization.*": "norm",
        "**.bias": "bias",
        "classifier.weight": "head",
        "**.weight": "hidden",  # the first 3×3 convolution is a full one (groups 1)
    },
}


build = transformers_builds(BUILDERS)


def expected_role(arch: str, name: str) -> str:
    for pattern, role in ROLES[arch].items():
        if glob_regex(pattern).fullmatch(name):
            return role
    raise AssertionError(f"{arch}: no pattern for {name!r}")


def test_every_family_has_a_table():
    assert set(ROLES) == set(ARCHS)


@pytest.mark.parametrize("arch", ARCHS)
def test_traced_roles_match_the_table(arch):
    infos, _ = model_params(build(arch))
    got = {p.name: p.role.name for p in infos}
    assert {n: (expected_role(arch, n), r) for n, r in got.items() if expected_role(arch, n) != r} == {}
    used = {next(pat for pat in ROLES[arch] if glob_regex(pat).fullmatch(n)) for n in got}
    assert sorted(set(ROLES[arch]) - used) == []  # no pattern is dead
    # the trace ran and reached every tensor that has elements
    assert {p.name: p.role.untraced for p in infos if p.role.basis != "trace" and 0 not in p.shape} == {}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("spec_name", SPECTRAL_SPECS)
def test_spectral_specs_route_the_traced_roles(spec_name, arch):
    plan = compile_spec(ROOT / "specs" / f"{spec_name}.yaml", build(arch))
    for pp in plan:
        roles = set(pp.role.split("+"))
        spectral = pp.geometry["kind"] == "spectral"
        assert spectral == bool(roles & SPECTRAL) and not (spectral and roles & NOT_SPECTRAL), (pp.name, pp.role)
        assert not (spectral and "other" in roles), pp.name


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("spec_name", ALL_SPECS)
def test_shipped_specs_lint_clean(spec_name, arch):
    spec = geomopt.load_spec(ROOT / "specs" / f"{spec_name}.yaml")
    diags = lint_spec(spec, model_params(build(arch))[0])
    assert [d.format() for d in diags if d.severity != "note"] == []
    assert [d.format() for d in diags if d.code == "GO124"] == []


@pytest.mark.parametrize("arch", ARCHS)
def test_the_optimizer_builds_on_traced_roles_without_a_warning(arch):
    model = build(arch)
    with warnings.catch_warnings():
        warnings.simplefilter("error", geomopt.RolesGuessedWarning)
        geomopt.GeomOptimizer(model, "muon")


def test_a_batch_of_one_traces_in_eval_mode_and_leaves_the_model_as_it_was():
    """A caller's batch of one fails in training (BatchNorm on the 1×1 map); the trace runs the
    forward again in eval mode: every tensor traced, the running statistics and each module's
    mode untouched."""
    model = build("efficientnet")
    model.train()
    model.efficientnet.encoder.blocks[0].eval()  # a mixed state, restored module by module
    modes = {n: m.training for n, m in model.named_modules()}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    one = {"pixel_values": torch.zeros(1, 3, 32, 32)}
    trace = trace_model(model, as_inputs(one))
    assert trace.device == "meta" and "Expected more than 1 value per channel when training" in trace.notes[0]
    infos, _ = model_params(model, example_inputs=one)
    assert {p.role.basis for p in infos} == {"trace"}
    assert {p.name: p.role.name for p in infos} == {p.name: expected_role("efficientnet", p.name) for p in infos}
    assert {n: m.training for n, m in model.named_modules()} == modes
    assert all(torch.equal(b, buffers[n]) for n, b in model.named_buffers())


def test_inputs_built_from_the_config():
    """Two rows; a dual tower gets pixels beside its tokens, LLaVA one placeholder per patch of
    its vision tower ((16 / 8)² = 4) before the text."""
    siglip = default_inputs(build("siglip")).kwargs
    assert siglip["input_ids"].shape == (2, 4) and siglip["pixel_values"].shape == (2, 3, 16, 16)
    llava = default_inputs(build("llava")).kwargs
    assert llava["input_ids"][:, :4].eq(60).all() and llava["input_ids"][:, 4:].ne(60).all()
    assert llava["pixel_values"].shape == (2, 3, 16, 16) and llava["attention_mask"].shape == (2, 8)
    assert default_inputs(build("efficientnet")).kwargs["pixel_values"].shape == (2, 3, 32, 32)
