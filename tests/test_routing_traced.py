"""Routing tables, tensor by tensor, for architectures whose tensors defeat names and module
classes: Mamba and Falcon-Mamba (A_log through exp, a depthwise short convolution), RWKV (per-channel
time-mix gates), Swin (an indexed relative-position table), DETR (two prediction heads, learned
object queries), Qwen2-VL (a Conv3d patch embedding reading pixels, a fused qkv), ModernBERT
(fused Wqkv and Wi cut by the forward) and Whisper (an audio stem) — transformers 5 models built
from tiny configs, random init, no download. Each role comes from the traced forward; the tables
are what a practitioner would route, and every shipped spec with a spectral rule must give the
spectral geometry exactly to the hidden matrices, one matrix per traced block.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from geomopt.compile import compile_spec
from geomopt.compile.compiler import model_params
from geomopt.geometry.view import describe

from test_routing import ALL_SPECS, NOT_SPECTRAL, SPECTRAL, SPECTRAL_SPECS, spec_findings, transformers_builds
from test_routing_views import assert_traced_roles

ROOT = Path(__file__).resolve().parents[1]

BUILDERS = {
    "mamba": lambda t: t.MambaForCausalLM(t.MambaConfig(
        vocab_size=64, hidden_size=32, state_size=8, num_hidden_layers=1, expand=2, conv_kernel=4)),
    "falcon-mamba": lambda t: t.FalconMambaForCausalLM(t.FalconMambaConfig(
        vocab_size=64, hidden_size=32, state_size=8, num_hidden_layers=1, expand=2, conv_kernel=4)),
    # two blocks: RWKV's initialization divides by (layers − 1)
    "rwkv": lambda t: t.RwkvForCausalLM(t.RwkvConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, attention_hidden_size=32, intermediate_size=64,
        context_length=16)),
    "swin": lambda t: t.SwinForImageClassification(t.SwinConfig(
        image_size=32, patch_size=4, num_channels=3, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4,
        num_labels=5)),
    # a ResNet backbone built from its config (no timm, no pretrained weights)
    "detr": lambda t: t.DetrForObjectDetection(t.DetrConfig(
        use_timm_backbone=False, use_pretrained_backbone=False,
        backbone_config=t.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], out_features=["stage2"]),
        d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=32, decoder_ffn_dim=32, num_queries=4, num_labels=3)),
    # the image placeholder inside the tiny vocabulary, so the traced forward runs the vision tower
    "qwen2-vl": lambda t: t.Qwen2VLForConditionalGeneration(t.Qwen2VLConfig(
        text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2,
                         rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}),
        vision_config=dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=2,
                           spatial_merge_size=2, temporal_patch_size=2, in_chans=3),
        image_token_id=60, video_token_id=61, vision_start_token_id=62, vision_end_token_id=63)),
    "modernbert": lambda t: t.ModernBertForMaskedLM(t.ModernBertConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        pad_token_id=0, global_attn_every_n_layers=2, local_attention=8)),
    "whisper": lambda t: t.WhisperForConditionalGeneration(t.WhisperConfig(
        vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8, max_source_positions=8,
        max_target_positions=16, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)),
}
ARCHS = list(BUILDERS)


build = transformers_builds(BUILDERS)


ROLES = {
    "mamba": {
        "backbone.embeddings.weight": "embedding+head",
        "backbone.layers.0.norm.weight": "norm",
        "backbone.layers.0.mixer.A_log": "other",
        "backbone.layers.0.mixer.D": "other",
        "backbone.layers.0.mixer.conv1d.weight": "other",
        "backbone.layers.0.mixer.conv1d.bias": "bias",
        "backbone.layers.0.mixer.in_proj.weight": "hidden",
        "backbone.layers.0.mixer.x_proj.weight": "hidden",
        "backbone.layers.0.mixer.dt_proj.weight": "hidden",
        "backbone.layers.0.mixer.dt_proj.bias": "bias",
        "backbone.layers.0.mixer.out_proj.weight": "hidden",
        "backbone.norm_f.weight": "norm",
    },
    "falcon-mamba": None,  # Mamba's table: the same blocks (filled in below)
    "rwkv": {
        "rwkv.embeddings.weight": "embedding",
        "rwkv.blocks.0.pre_ln.weight": "norm",
        "rwkv.blocks.0.pre_ln.bias": "norm",
        "rwkv.blocks.0.ln1.weight": "norm",
        "rwkv.blocks.0.ln1.bias": "norm",
        "rwkv.blocks.0.ln2.weight": "norm",
        "rwkv.blocks.0.ln2.bias": "norm",
        "rwkv.blocks.0.attention.time_decay": "other",
        "rwkv.blocks.0.attention.time_first": "other",
        "rwkv.blocks.0.attention.time_mix_key": "other",
        "rwkv.blocks.0.attention.time_mix_value": "other",
        "rwkv.blocks.0.attention.time_mix_receptance": "other",
        "rwkv.blocks.0.attention.key.weight": "hidden",
        "rwkv.blocks.0.attention.value.weight": "hidden",
        "rwkv.blocks.0.attention.receptance.weight": "hidden",
        "rwkv.blocks.0.attention.output.weight": "hidden",
        "rwkv.blocks.0.feed_forward.time_mix_key": "other",
        "rwkv.blocks.0.feed_forward.time_mix_receptance": "other",
        "rwkv.blocks.0.feed_forward.key.weight": "hidden",
        "rwkv.blocks.0.feed_forward.receptance.weight": "hidden",
        "rwkv.blocks.0.feed_forward.value.weight": "hidden",
        "rwkv.blocks.1.ln1.weight": "norm",
        "rwkv.blocks.1.ln1.bias": "norm",
        "rwkv.blocks.1.ln2.weight": "norm",
        "rwkv.blocks.1.ln2.bias": "norm",
        "rwkv.blocks.1.attention.time_decay": "other",
        "rwkv.blocks.1.attention.time_first": "other",
        "rwkv.blocks.1.attention.time_mix_key": "other",
        "rwkv.blocks.1.attention.time_mix_value": "other",
        "rwkv.blocks.1.attention.time_mix_receptance": "other",
        "rwkv.blocks.1.attention.key.weight": "hidden",
        "rwkv.blocks.1.attention.value.weight": "hidden",
        "rwkv.blocks.1.attention.receptance.weight": "hidden",
        "rwkv.blocks.1.attention.output.weight": "hidden",
        "rwkv.blocks.1.feed_forward.time_mix_key": "other",
        "rwkv.blocks.1.feed_forward.time_mix_receptance": "other",
        "rwkv.blocks.1.feed_forward.key.weight": "hidden",
        "rwkv.blocks.1.feed_forward.receptance.weight": "hidden",
        "rwkv.blocks.1.feed_forward.value.weight": "hidden",
        "rwkv.ln_out.weight": "norm",
        "rwkv.ln_out.bias": "norm",
        "head.weight": "head",
    },
    "swin": {
        "swin.embeddings.patch_embeddings.projection.weight": "embedding",
        "swin.embeddings.patch_embeddings.projection.bias": "bias",
        "swin.embeddings.norm.weight": "norm",
        "swin.embeddings.norm.bias": "norm",
        "swin.encoder.layers.0.blocks.0.attention.q_proj.weight": "hidden",
        "swin.encoder.layers.0.blocks.0.attention.q_proj.bias": "bias",
        "swin.encoder.layers.0.blocks.0.attention.k_proj.weight": "hidden",
        "swin.encoder.layers.0.blocks.0.attention.k_proj.bias": "bias",
        "swin.encoder.layers.0.blocks.0.attention.v_proj.weight": "hidden",
        "swin.encoder.layers.0.blocks.0.attention.v_proj.bias": "bias",
        "swin.encoder.layers.0.blocks.0.attention.o_proj.weight": "hidden",
        "swin.encoder.layers.0.blocks.0.attention.o_proj.bias": "bias",
        "swin.encoder.layers.0.blocks.0.attention.relative_position_bias.relative_position_bias_table": "other",
        "swin.encoder.layers.0.blocks.0.layernorm_before.weight": "norm",
        "swin.encoder.layers.0.blocks.0.layernorm_before.bias": "norm",
        "swin.encoder.layers.0.blocks.0.layernorm_after.weight": "norm",
        "swin.encoder.layers.0.blocks.0.layernorm_after.bias": "norm",
        "swin.encoder.layers.0.blocks.0.mlp.fc1.weight": "hidden",
        "swin.encoder.layers.0.blocks.0.mlp.fc1.bias": "bias",
        "swin.encoder.layers.0.blocks.0.mlp.fc2.weight": "hidden",
        "swin.encoder.layers.0.blocks.0.mlp.fc2.bias": "bias",
        "swin.encoder.layers.0.downsample.reduction.weight": "hidden",
        "swin.encoder.layers.0.downsample.norm.weight": "norm",
        "swin.encoder.layers.0.downsample.norm.bias": "norm",
        "swin.encoder.layers.1.blocks.0.attention.q_proj.weight": "hidden",
        "swin.encoder.layers.1.blocks.0.attention.q_proj.bias": "bias",
        "swin.encoder.layers.1.blocks.0.attention.k_proj.weight": "hidden",
        "swin.encoder.layers.1.blocks.0.attention.k_proj.bias": "bias",
        "swin.encoder.layers.1.blocks.0.attention.v_proj.weight": "hidden",
        "swin.encoder.layers.1.blocks.0.attention.v_proj.bias": "bias",
        "swin.encoder.layers.1.blocks.0.attention.o_proj.weight": "hidden",
        "swin.encoder.layers.1.blocks.0.attention.o_proj.bias": "bias",
        "swin.encoder.layers.1.blocks.0.attention.relative_position_bias.relative_position_bias_table": "other",
        "swin.encoder.layers.1.blocks.0.layernorm_before.weight": "norm",
        "swin.encoder.layers.1.blocks.0.layernorm_before.bias": "norm",
        "swin.encoder.layers.1.blocks.0.layernorm_after.weight": "norm",
        "swin.encoder.layers.1.blocks.0.layernorm_after.bias": "norm",
        "swin.encoder.layers.1.blocks.0.mlp.fc1.weight": "hidden",
        "swin.encoder.layers.1.blocks.0.mlp.fc1.bias": "bias",
        "swin.encoder.layers.1.blocks.0.mlp.fc2.weight": "hidden",
        "swin.encoder.layers.1.blocks.0.mlp.fc2.bias": "bias",
        "swin.layernorm.weight": "norm",
        "swin.layernorm.bias": "norm",
        "classifier.weight": "head",
        "classifier.bias": "bias",
    },
    "detr": {
        "model.backbone.model.embedder.embedder.convolution.weight": "embedding",
        "model.backbone.model.encoder.stages.0.layers.0.layer.0.convolution.weight": "hidden",
        "model.backbone.model.encoder.stages.0.layers.0.layer.1.convolution.weight": "hidden",
        "model.backbone.model.encoder.stages.0.layers.0.layer.2.convolution.weight": "hidden",
        "model.backbone.model.encoder.stages.1.layers.0.shortcut.convolution.weight": "hidden",
        "model.backbone.model.encoder.stages.1.layers.0.layer.0.convolution.weight": "hidden",
        "model.backbone.model.encoder.stages.1.layers.0.layer.1.convolution.weight": "hidden",
        "model.backbone.model.encoder.stages.1.layers.0.layer.2.convolution.weight": "hidden",
        "model.query_position_embeddings.weight": "embedding",
        "model.input_projection.weight": "hidden",
        "model.input_projection.bias": "bias",
        "model.encoder.layers.0.self_attn.k_proj.weight": "hidden",
        "model.encoder.layers.0.self_attn.k_proj.bias": "bias",
        "model.encoder.layers.0.self_attn.v_proj.weight": "hidden",
        "model.encoder.layers.0.self_attn.v_proj.bias": "bias",
        "model.encoder.layers.0.self_attn.q_proj.weight": "hidden",
        "model.encoder.layers.0.self_attn.q_proj.bias": "bias",
        "model.encoder.layers.0.self_attn.o_proj.weight": "hidden",
        "model.encoder.layers.0.self_attn.o_proj.bias": "bias",
        "model.encoder.layers.0.self_attn_layer_norm.weight": "norm",
        "model.encoder.layers.0.self_attn_layer_norm.bias": "norm",
        "model.encoder.layers.0.mlp.fc1.weight": "hidden",
        "model.encoder.layers.0.mlp.fc1.bias": "bias",
        "model.encoder.layers.0.mlp.fc2.weight": "hidden",
        "model.encoder.layers.0.mlp.fc2.bias": "bias",
        "model.encoder.layers.0.final_layer_norm.weight": "norm",
        "model.encoder.layers.0.final_layer_norm.bias": "norm",
        "model.decoder.layers.0.self_attn.k_proj.weight": "hidden",
        "model.decoder.layers.0.self_attn.k_proj.bias": "bias",
        "model.decoder.layers.0.self_attn.v_proj.weight": "hidden",
        "model.decoder.layers.0.self_attn.v_proj.bias": "bias",
        "model.decoder.layers.0.self_attn.q_proj.weight": "hidden",
        "model.decoder.layers.0.self_attn.q_proj.bias": "bias",
        "model.decoder.layers.0.self_attn.o_proj.weight": "hidden",
        "model.decoder.layers.0.self_attn.o_proj.bias": "bias",
        "model.decoder.layers.0.self_attn_layer_norm.weight": "norm",
        "model.decoder.layers.0.self_attn_layer_norm.bias": "norm",
        "model.decoder.layers.0.encoder_attn.k_proj.weight": "hidden",
        "model.decoder.layers.0.encoder_attn.k_proj.bias": "bias",
        "model.decoder.layers.0.encoder_attn.v_proj.weight": "hidden",
        "model.decoder.layers.0.encoder_attn.v_proj.bias": "bias",
        "model.decoder.layers.0.encoder_attn.q_proj.weight": "hidden",
        "model.decoder.layers.0.encoder_attn.q_proj.bias": "bias",
        "model.decoder.layers.0.encoder_attn.o_proj.weight": "hidden",
        "model.decoder.layers.0.encoder_attn.o_proj.bias": "bias",
        "model.decoder.layers.0.encoder_attn_layer_norm.weight": "norm",
        "model.decoder.layers.0.encoder_attn_layer_norm.bias": "norm",
        "model.decoder.layers.0.mlp.fc1.weight": "hidden",
        "model.decoder.layers.0.mlp.fc1.bias": "bias",
        "model.decoder.layers.0.mlp.fc2.weight": "hidden",
        "model.decoder.layers.0.mlp.fc2.bias": "bias",
        "model.decoder.layers.0.final_layer_norm.weight": "norm",
        "model.decoder.layers.0.final_layer_norm.bias": "norm",
        "model.decoder.layernorm.weight": "norm",
        "model.decoder.layernorm.bias": "norm",
        "class_labels_classifier.weight": "head",
        "class_labels_classifier.bias": "bias",
        "bbox_predictor.layers.0.weight": "hidden",
        "bbox_predictor.layers.0.bias": "bias",
        "bbox_predictor.layers.1.weight": "hidden",
        "bbox_predictor.layers.1.bias": "bias",
        "bbox_predictor.layers.2.weight": "head",
        "bbox_predictor.layers.2.bias": "bias",
    },
    "qwen2-vl": {
        "model.visual.patch_embed.proj.weight": "embedding",
        "model.visual.blocks.0.norm1.weight": "norm",
        "model.visual.blocks.0.norm1.bias": "norm",
        "model.visual.blocks.0.norm2.weight": "norm",
        "model.visual.blocks.0.norm2.bias": "norm",
        "model.visual.blocks.0.attn.qkv.weight": "hidden",
        "model.visual.blocks.0.attn.qkv.bias": "bias",
        "model.visual.blocks.0.attn.proj.weight": "hidden",
        "model.visual.blocks.0.attn.proj.bias": "bias",
        "model.visual.blocks.0.mlp.fc1.weight": "hidden",
        "model.visual.blocks.0.mlp.fc1.bias": "bias",
        "model.visual.blocks.0.mlp.fc2.weight": "hidden",
        "model.visual.blocks.0.mlp.fc2.bias": "bias",
        "model.visual.merger.ln_q.weight": "norm",
        "model.visual.merger.ln_q.bias": "norm",
        "model.visual.merger.mlp.0.weight": "hidden",
        "model.visual.merger.mlp.0.bias": "bias",
        "model.visual.merger.mlp.2.weight": "hidden",
        "model.visual.merger.mlp.2.bias": "bias",
        "model.language_model.embed_tokens.weight": "embedding",
        "model.language_model.layers.0.self_attn.q_proj.weight": "hidden",
        "model.language_model.layers.0.self_attn.q_proj.bias": "bias",
        "model.language_model.layers.0.self_attn.k_proj.weight": "hidden",
        "model.language_model.layers.0.self_attn.k_proj.bias": "bias",
        "model.language_model.layers.0.self_attn.v_proj.weight": "hidden",
        "model.language_model.layers.0.self_attn.v_proj.bias": "bias",
        "model.language_model.layers.0.self_attn.o_proj.weight": "hidden",
        "model.language_model.layers.0.mlp.gate_proj.weight": "hidden",
        "model.language_model.layers.0.mlp.up_proj.weight": "hidden",
        "model.language_model.layers.0.mlp.down_proj.weight": "hidden",
        "model.language_model.layers.0.input_layernorm.weight": "norm",
        "model.language_model.layers.0.post_attention_layernorm.weight": "norm",
        "model.language_model.norm.weight": "norm",
        "lm_head.weight": "head",
    },
    "modernbert": {
        "model.embeddings.tok_embeddings.weight": "embedding+head",
        "model.embeddings.norm.weight": "norm",
        "model.layers.0.attn.Wqkv.weight": "hidden",
        "model.layers.0.attn.Wo.weight": "hidden",
        "model.layers.0.mlp_norm.weight": "norm",
        "model.layers.0.mlp.Wi.weight": "hidden",
        "model.layers.0.mlp.Wo.weight": "hidden",
        "model.final_norm.weight": "norm",
        "head.dense.weight": "hidden",
        "head.norm.weight": "norm",
        "decoder.bias": "bias",
    },
    "whisper": {
        "model.encoder.conv1.weight": "embedding",
        "model.encoder.conv1.bias": "bias",
        "model.encoder.conv2.weight": "hidden",
        "model.encoder.conv2.bias": "bias",
        "model.encoder.embed_positions.weight": "embedding",
        "model.encoder.layers.0.self_attn.k_proj.weight": "hidden",
        "model.encoder.layers.0.self_attn.v_proj.weight": "hidden",
        "model.encoder.layers.0.self_attn.v_proj.bias": "bias",
        "model.encoder.layers.0.self_attn.q_proj.weight": "hidden",
        "model.encoder.layers.0.self_attn.q_proj.bias": "bias",
        "model.encoder.layers.0.self_attn.out_proj.weight": "hidden",
        "model.encoder.layers.0.self_attn.out_proj.bias": "bias",
        "model.encoder.layers.0.self_attn_layer_norm.weight": "norm",
        "model.encoder.layers.0.self_attn_layer_norm.bias": "norm",
        "model.encoder.layers.0.fc1.weight": "hidden",
        "model.encoder.layers.0.fc1.bias": "bias",
        "model.encoder.layers.0.fc2.weight": "hidden",
        "model.encoder.layers.0.fc2.bias": "bias",
        "model.encoder.layers.0.final_layer_norm.weight": "norm",
        "model.encoder.layers.0.final_layer_norm.bias": "norm",
        "model.encoder.layer_norm.weight": "norm",
        "model.encoder.layer_norm.bias": "norm",
        "model.decoder.embed_tokens.weight": "embedding+head",
        "model.decoder.embed_positions.weight": "embedding",
        "model.decoder.layers.0.self_attn.k_proj.weight": "hidden",
        "model.decoder.layers.0.self_attn.v_proj.weight": "hidden",
        "model.decoder.layers.0.self_attn.v_proj.bias": "bias",
        "model.decoder.layers.0.self_attn.q_proj.weight": "hidden",
        "model.decoder.layers.0.self_attn.q_proj.bias": "bias",
        "model.decoder.layers.0.self_attn.out_proj.weight": "hidden",
        "model.decoder.layers.0.self_attn.out_proj.bias": "bias",
        "model.decoder.layers.0.self_attn_layer_norm.weight": "norm",
        "model.decoder.layers.0.self_attn_layer_norm.bias": "norm",
        "model.decoder.layers.0.encoder_attn.k_proj.weight": "hidden",
        "model.decoder.layers.0.encoder_attn.v_proj.weight": "hidden",
        "model.decoder.layers.0.encoder_attn.v_proj.bias": "bias",
        "model.decoder.layers.0.encoder_attn.q_proj.weight": "hidden",
        "model.decoder.layers.0.encoder_attn.q_proj.bias": "bias",
        "model.decoder.layers.0.encoder_attn.out_proj.weight": "hidden",
        "model.decoder.layers.0.encoder_attn.out_proj.bias": "bias",
        "model.decoder.layers.0.encoder_attn_layer_norm.weight": "norm",
        "model.decoder.layers.0.encoder_attn_layer_norm.bias": "norm",
        "model.decoder.layers.0.fc1.weight": "hidden",
        "model.decoder.layers.0.fc1.bias": "bias",
        "model.decoder.layers.0.fc2.weight": "hidden",
        "model.decoder.layers.0.fc2.bias": "bias",
        "model.decoder.layers.0.final_layer_norm.weight": "norm",
        "model.decoder.layers.0.final_layer_norm.bias": "norm",
        "model.decoder.layer_norm.weight": "norm",
        "model.decoder.layer_norm.bias": "norm",
    },
}

ROLES["falcon-mamba"] = ROLES["mamba"]

# what an ``auto`` view reads, from the forward's cuts of each layer's output; none elsewhere
STRUCTURES = {
    # in_proj's output is chunked into the scan input x and the gate z; x_proj's split into the
    # time step (rank 2) and the state projections B and C (state size 8)
    "mamba": {"backbone.layers.0.mixer.in_proj.weight": {"batch": 0, "blocks": [64, 64]},
              "backbone.layers.0.mixer.x_proj.weight": {"batch": 0, "blocks": [2, 8, 8]}},
    "falcon-mamba": {"backbone.layers.0.mixer.in_proj.weight": {"batch": 0, "blocks": [64, 64]},
                     "backbone.layers.0.mixer.x_proj.weight": {"batch": 0, "blocks": [2, 8, 8]}},
    "qwen2-vl": {"model.visual.blocks.0.attn.qkv.weight": {"batch": 0, "blocks": [16, 16, 16]}},
    # Wqkv viewed (…, 3, heads, head dim) and unbound; Wi chunked into input and gate
    "modernbert": {"model.layers.0.attn.Wqkv.weight": {"batch": 0, "blocks": [32, 32, 32]},
                   "model.layers.0.mlp.Wi.weight": {"batch": 0, "blocks": [48, 48]}},
}
VIEWS = {
    "mamba": {"backbone.layers.0.mixer.in_proj.weight": "2 × 64×32",
              "backbone.layers.0.mixer.x_proj.weight": "2×64 + 2 × 8×64"},
    "modernbert": {"model.layers.0.mlp.Wi.weight": "2 × 48×32", "model.layers.0.attn.Wqkv.weight": "3 × 32×32"},
}


def test_tables_name_every_tensor_and_are_traced():
    assert set(ROLES) == set(ARCHS) and set(STRUCTURES) <= set(ARCHS)


@pytest.mark.parametrize("arch", ARCHS)
def test_traced_roles_match_the_table(arch):
    infos = assert_traced_roles(build(arch), ROLES[arch])
    assert {p.name: p.role.structure for p in infos if p.role.structure} == STRUCTURES.get(arch, {})


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("spec_name", SPECTRAL_SPECS)
def test_spectral_specs_route_the_traced_roles(spec_name, arch):
    plan = compile_spec(ROOT / "specs" / f"{spec_name}.yaml", build(arch))
    views = VIEWS.get(arch, {})
    for pp in plan:
        roles = set(pp.role.split("+"))
        assert pp.role == ROLES[arch][pp.name], pp.name
        spectral = pp.geometry["kind"] == "spectral"
        assert spectral == bool(roles & SPECTRAL) and not (spectral and roles & NOT_SPECTRAL), (pp.name, pp.role)
        assert not (spectral and "other" in roles), pp.name
        if pp.name in views:
            assert describe(pp.geometry["view"], pp.op_shape) == views[pp.name], pp.name


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("spec_name", ALL_SPECS)
def test_shipped_specs_lint_clean(spec_name, arch):
    assert spec_findings(spec_name, build(arch)) == []


def test_the_module_tree_alone_would_have_misrouted_them():
    """What the trace fixed: without it (no inputs) these tensors would be hidden matrices."""
    wrong = {"mamba": "backbone.layers.0.mixer.A_log",
             "swin": "swin.encoder.layers.0.blocks.0.attention.relative_position_bias.relative_position_bias_table",
             "qwen2-vl": "model.visual.patch_embed.proj.weight", "detr": "class_labels_classifier.weight"}
    for arch, name in wrong.items():
        model = build(arch)
        traced = {p.name: p.role for p in model_params(model)[0]}[name]
        assert traced.name == ROLES[arch][name] != "hidden"
        assert traced.inferred.startswith("hidden: ")  # the module tree's verdict, kept beside the trace's
    # RWKV's (1, 1, d) time-mix gates are single rows: the module tree calls them other too
    gate = {p.name: p.role for p in model_params(build("rwkv"))[0]}["rwkv.blocks.0.attention.time_mix_key"]
    assert gate.name == "other" and gate.inferred is None and "a single row (1×1×32)" in gate.evidence
