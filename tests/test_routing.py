"""Routing tables per architecture, tensor by tensor.

For each architecture (Hugging Face GPT-2, Llama, Qwen2-MoE with a shared expert, Mixtral, BERT,
ViT, T5 — tiny configs, random init, no downloads —, a torchvision-style ResNet-18, an
``nn.TransformerEncoder`` classifier and the built-in ``gpt``, ``mlp``, ``cnn``) an explicit table
gives every tensor's expected role (and the structure an ``auto`` view reads); the inferred roles
must equal it and it must name every tensor. Then every shipped spec with a spectral rule must
route the tensors by role: embeddings, heads, routers, norms and biases never get the spectral
geometry, hidden and expert matrices always do, with E matrices per batched expert weight and one
matrix per block of a fused projection. Last, one Muon step on Mixtral checks that the expert
weights are orthogonalized expert by expert and gate/up half by half.

The Hugging Face tables are transformers 5's parameter names (fused MoE experts, ViT's
``q_proj``…): with an older transformers those cases skip.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import pytest
import torch
from torch import nn

import geomopt
from geomopt.compile import compile_spec
from geomopt.lint import lint_spec
from geomopt.compile.compiler import model_params
from geomopt.geometry.view import describe
from geomopt.models import get_model

ROOT = Path(__file__).resolve().parents[1]
SPECTRAL_SPECS = ["muon", "scion", "uscion", "adamw-hybrid", "hyperball", "prox-muon-frobenius", "spectral-clip",
                  "stiefel"]
NOT_SPECTRAL = {"embedding", "head", "router", "norm", "bias"}
SPECTRAL = {"hidden", "expert"}


def _transformers():
    transformers = pytest.importorskip("transformers")
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("the expected tables hold transformers 5's parameter names")
    transformers.logging.set_verbosity_error()
    return transformers


def transformers_builds(builders: dict):
    """``build(arch)``: the model ``builders[arch](transformers)``, seeded and built once."""

    @functools.cache
    def built(arch: str):
        torch.manual_seed(0)
        return builders[arch](_transformers())

    def build(arch: str):
        _transformers()  # skips before the cache would remember a failure
        return built(arch)

    return build


def _layers(prefix: str, n: int, per_layer: dict) -> dict:
    """``per_layer`` (a literal per-layer table) for layers 0 … n−1 under ``prefix`` (with ``{i}``)."""
    return {prefix.format(i=i) + name: value for i in range(n) for name, value in per_layer.items()}


# ---------------------------------------------------------------- a torchvision ResNet-18, by hand
# torchvision cannot be installed here (from PyPI it pulls a multi-GB CUDA torch over the CPU one),
# so this is torchvision.models.resnet18's module structure and parameter names, written out:
# conv1, bn1, relu, maxpool, layer1..layer4 of two BasicBlocks (conv1/bn1/conv2/bn2, and
# downsample = Sequential(1×1 Conv2d, BatchNorm2d) on the first block of layers 2–4), avgpool, fc.
# ``width`` scales the channels (torchvision: 64) to keep the test fast; names are unchanged.


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample=None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet18(nn.Module):
    def __init__(self, num_classes: int = 1000, width: int = 64):
        super().__init__()
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, width, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(width, 2)
        self.layer2 = self._make_layer(2 * width, 2, stride=2)
        self.layer3 = self._make_layer(4 * width, 2, stride=2)
        self.layer4 = self._make_layer(8 * width, 2, stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(8 * width, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def _make_layer(self, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes:
            downsample = nn.Sequential(nn.Conv2d(self.inplanes, planes, kernel_size=1, stride=stride, bias=False),
                                       nn.BatchNorm2d(planes))
        layers = [BasicBlock(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes
        layers += [BasicBlock(planes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def example_inputs(self):
        """Two 32×32 images (BatchNorm in training mode needs more than one value per channel)."""
        return torch.zeros(2, 3, 32, 32)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class EncoderClassifier(nn.Module):
    """Token embedding, nn.TransformerEncoder (batch_first layers, a final LayerNorm), a classifier
    registered last."""

    def __init__(self, vocab: int = 64, d: int = 32, heads: int = 4, ff: int = 64, n_layers: int = 2,
                 n_classes: int = 3):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, heads, ff, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, n_layers, norm=nn.LayerNorm(d), enable_nested_tensor=False)
        self.classifier = nn.Linear(d, n_classes)

    def example_inputs(self):
        return torch.zeros(1, 5, dtype=torch.long)

    def forward(self, idx):
        return self.classifier(self.encoder(self.embed(idx)).mean(1))


# ---------------------------------------------------------------- the models (tiny configs)


def _hf_gpt2():
    t = _transformers()
    return t.GPT2LMHeadModel(t.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16))


def _llama():
    t = _transformers()
    # intermediate 64 = (heads 4 + 2·kv heads 2)·head dim 8: an MLP weight with q+k+v's row count,
    # which must not be taken for a fused q, k, v projection
    return t.LlamaForCausalLM(t.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16))


def _qwen2_moe():
    t = _transformers()
    # shared expert 64 rows = (4 + 2·2)·8 as in _llama
    return t.Qwen2MoeForCausalLM(t.Qwen2MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=24,
        shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16))


def _mixtral():
    t = _transformers()
    # experts (E=4, 2·32, 16) gate_up and (4, 16, 32) down: tall gate/up halves, √2 muon_original scale
    return t.MixtralForCausalLM(t.MixtralConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16))


def _bert():
    t = _transformers()
    return t.BertForSequenceClassification(t.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=16, num_labels=3))


def _vit():
    t = _transformers()
    return t.ViTForImageClassification(t.ViTConfig(
        image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, num_labels=5))


def _t5():
    t = _transformers()
    return t.T5ForConditionalGeneration(t.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4))


BUILDERS = {
    "hf-gpt2": _hf_gpt2,
    "llama": _llama,
    "qwen2-moe": _qwen2_moe,
    "mixtral": _mixtral,
    "bert": _bert,
    "vit": _vit,
    "t5": _t5,
    "resnet18": lambda: ResNet18(num_classes=10, width=8),
    "transformer-encoder": EncoderClassifier,
    "gpt": lambda: get_model("gpt"),
    "mlp": lambda: get_model("mlp"),
    "cnn": lambda: get_model("cnn"),
}
ARCHS = list(BUILDERS)


@functools.cache
def _built(arch: str) -> nn.Module:
    torch.manual_seed(0)
    return BUILDERS[arch]()


def build(arch: str) -> nn.Module:
    """The architecture's (shared, never stepped) model."""
    if arch in ("hf-gpt2", "llama", "qwen2-moe", "mixtral", "bert", "vit", "t5"):
        _transformers()  # skips before the cache would remember a failure
    return _built(arch)


# ---------------------------------------------------------------- the expected tables

# nanoGPT / GPT-2 blocks (Hugging Face GPT-2 and the built-in gpt share the names)
GPT2_LAYER = {
    "ln_1.weight": "norm", "ln_1.bias": "norm",
    "attn.c_attn.weight": "hidden", "attn.c_attn.bias": "bias",
    "attn.c_proj.weight": "hidden", "attn.c_proj.bias": "bias",
    "ln_2.weight": "norm", "ln_2.bias": "norm",
    "mlp.c_fc.weight": "hidden", "mlp.c_fc.bias": "bias",
    "mlp.c_proj.weight": "hidden", "mlp.c_proj.bias": "bias",
}

LLAMA_LAYER = {
    "self_attn.q_proj.weight": "hidden",
    "self_attn.k_proj.weight": "hidden",
    "self_attn.v_proj.weight": "hidden",
    "self_attn.o_proj.weight": "hidden",
    "mlp.gate_proj.weight": "hidden",
    "mlp.up_proj.weight": "hidden",
    "mlp.down_proj.weight": "hidden",
    "input_layernorm.weight": "norm",
    "post_attention_layernorm.weight": "norm",
}

QWEN2_MOE_LAYER = {
    "self_attn.q_proj.weight": "hidden", "self_attn.q_proj.bias": "bias",
    "self_attn.k_proj.weight": "hidden", "self_attn.k_proj.bias": "bias",
    "self_attn.v_proj.weight": "hidden", "self_attn.v_proj.bias": "bias",
    "self_attn.o_proj.weight": "hidden",
    "mlp.gate.weight": "router",
    "mlp.experts.gate_up_proj": "expert",
    "mlp.experts.down_proj": "expert",
    "mlp.shared_expert.gate_proj.weight": "hidden",
    "mlp.shared_expert.up_proj.weight": "hidden",
    "mlp.shared_expert.down_proj.weight": "hidden",
    "mlp.shared_expert_gate.weight": "router",
    "input_layernorm.weight": "norm",
    "post_attention_layernorm.weight": "norm",
}

MIXTRAL_LAYER = {
    "self_attn.q_proj.weight": "hidden",
    "self_attn.k_proj.weight": "hidden",
    "self_attn.v_proj.weight": "hidden",
    "self_attn.o_proj.weight": "hidden",
    "mlp.gate.weight": "router",
    "mlp.experts.gate_up_proj": "expert",
    "mlp.experts.down_proj": "expert",
    "input_layernorm.weight": "norm",
    "post_attention_layernorm.weight": "norm",
}

BERT_LAYER = {
    "attention.self.query.weight": "hidden", "attention.self.query.bias": "bias",
    "attention.self.key.weight": "hidden", "attention.self.key.bias": "bias",
    "attention.self.value.weight": "hidden", "attention.self.value.bias": "bias",
    "attention.output.dense.weight": "hidden", "attention.output.dense.bias": "bias",
    "attention.output.LayerNorm.weight": "norm", "attention.output.LayerNorm.bias": "norm",
    "intermediate.dense.weight": "hidden", "intermediate.dense.bias": "bias",
    "output.dense.weight": "hidden", "output.dense.bias": "bias",
    "output.LayerNorm.weight": "norm", "output.LayerNorm.bias": "norm",
}

VIT_LAYER = {
    "attention.q_proj.weight": "hidden", "attention.q_proj.bias": "bias",
    "attention.k_proj.weight": "hidden", "attention.k_proj.bias": "bias",
    "attention.v_proj.weight": "hidden", "attention.v_proj.bias": "bias",
    "attention.o_proj.weight": "hidden", "attention.o_proj.bias": "bias",
    "layernorm_before.weight": "norm", "layernorm_before.bias": "norm",
    "layernorm_after.weight": "norm", "layernorm_after.bias": "norm",
    "mlp.fc1.weight": "hidden", "mlp.fc1.bias": "bias",
    "mlp.fc2.weight": "hidden", "mlp.fc2.bias": "bias",
}

T5_ENCODER_BLOCK = {
    "layer.0.SelfAttention.q.weight": "hidden",
    "layer.0.SelfAttention.k.weight": "hidden",
    "layer.0.SelfAttention.v.weight": "hidden",
    "layer.0.SelfAttention.o.weight": "hidden",
    "layer.0.layer_norm.weight": "norm",
    "layer.1.DenseReluDense.wi.weight": "hidden",
    "layer.1.DenseReluDense.wo.weight": "hidden",
    "layer.1.layer_norm.weight": "norm",
}

T5_DECODER_BLOCK = {
    "layer.0.SelfAttention.q.weight": "hidden",
    "layer.0.SelfAttention.k.weight": "hidden",
    "layer.0.SelfAttention.v.weight": "hidden",
    "layer.0.SelfAttention.o.weight": "hidden",
    "layer.0.layer_norm.weight": "norm",
    "layer.1.EncDecAttention.q.weight": "hidden",
    "layer.1.EncDecAttention.k.weight": "hidden",
    "layer.1.EncDecAttention.v.weight": "hidden",
    "layer.1.EncDecAttention.o.weight": "hidden",
    "layer.1.layer_norm.weight": "norm",
    "layer.2.DenseReluDense.wi.weight": "hidden",
    "layer.2.DenseReluDense.wo.weight": "hidden",
    "layer.2.layer_norm.weight": "norm",
}

RESNET_BLOCK = {
    "conv1.weight": "hidden",
    "bn1.weight": "norm", "bn1.bias": "norm",
    "conv2.weight": "hidden",
    "bn2.weight": "norm", "bn2.bias": "norm",
}
RESNET_DOWNSAMPLE = {
    "downsample.0.weight": "hidden",
    "downsample.1.weight": "norm", "downsample.1.bias": "norm",
}

ENCODER_LAYER = {
    "self_attn.in_proj_weight": "hidden", "self_attn.in_proj_bias": "bias",
    "self_attn.out_proj.weight": "hidden", "self_attn.out_proj.bias": "bias",
    "linear1.weight": "hidden", "linear1.bias": "bias",
    "linear2.weight": "hidden", "linear2.bias": "bias",
    "norm1.weight": "norm", "norm1.bias": "norm",
    "norm2.weight": "norm", "norm2.bias": "norm",
}


def _resnet_table() -> dict:
    table = {"conv1.weight": "hidden", "bn1.weight": "norm", "bn1.bias": "norm"}
    for stage in (1, 2, 3, 4):
        table.update(_layers(f"layer{stage}.{{i}}.", 2, RESNET_BLOCK))
        if stage > 1:  # torchvision: a downsample on the first block of layers 2–4
            table.update(_layers(f"layer{stage}.0.", 1, RESNET_DOWNSAMPLE))
    table.update({"fc.weight": "head", "fc.bias": "bias"})
    return table


ROLES = {
    "hf-gpt2": {
        "transformer.wte.weight": "embedding+head",  # tied to lm_head.weight
        "transformer.wpe.weight": "embedding",
        **_layers("transformer.h.{i}.", 2, GPT2_LAYER),
        "transformer.ln_f.weight": "norm", "transformer.ln_f.bias": "norm",
    },
    "llama": {
        "model.embed_tokens.weight": "embedding",
        **_layers("model.layers.{i}.", 2, LLAMA_LAYER),
        "model.norm.weight": "norm",
        "lm_head.weight": "head",
    },
    "qwen2-moe": {
        "model.embed_tokens.weight": "embedding",
        **_layers("model.layers.{i}.", 2, QWEN2_MOE_LAYER),
        "model.norm.weight": "norm",
        "lm_head.weight": "head",
    },
    "mixtral": {
        "model.embed_tokens.weight": "embedding",
        **_layers("model.layers.{i}.", 2, MIXTRAL_LAYER),
        "model.norm.weight": "norm",
        "lm_head.weight": "head",
    },
    "bert": {
        "bert.embeddings.word_embeddings.weight": "embedding",
        "bert.embeddings.position_embeddings.weight": "embedding",
        "bert.embeddings.token_type_embeddings.weight": "embedding",
        "bert.embeddings.LayerNorm.weight": "norm", "bert.embeddings.LayerNorm.bias": "norm",
        **_layers("bert.encoder.layer.{i}.", 2, BERT_LAYER),
        "bert.pooler.dense.weight": "hidden", "bert.pooler.dense.bias": "bias",
        "classifier.weight": "head", "classifier.bias": "bias",
    },
    "vit": {
        "vit.embeddings.cls_token": "embedding",
        "vit.embeddings.position_embeddings": "embedding",
        "vit.embeddings.patch_embeddings.projection.weight": "embedding",
        "vit.embeddings.patch_embeddings.projection.bias": "bias",
        **_layers("vit.layers.{i}.", 2, VIT_LAYER),
        "vit.layernorm.weight": "norm", "vit.layernorm.bias": "norm",
        "classifier.weight": "head", "classifier.bias": "bias",
    },
    "t5": {
        "shared.weight": "embedding+head",  # tied: both embed_tokens and lm_head
        **_layers("encoder.block.{i}.", 2, T5_ENCODER_BLOCK),
        "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight": "embedding",
        "encoder.final_layer_norm.weight": "norm",
        **_layers("decoder.block.{i}.", 2, T5_DECODER_BLOCK),
        "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight": "embedding",
        "decoder.final_layer_norm.weight": "norm",
    },
    "resnet18": _resnet_table(),
    "transformer-encoder": {
        "embed.weight": "embedding",
        **_layers("encoder.layers.{i}.", 2, ENCODER_LAYER),
        "encoder.norm.weight": "norm", "encoder.norm.bias": "norm",
        "classifier.weight": "head", "classifier.bias": "bias",
    },
    "gpt": {
        "transformer.wte.weight": "embedding",
        "transformer.wpe.weight": "embedding",
        **_layers("transformer.h.{i}.", 2, GPT2_LAYER),
        "transformer.ln_f.weight": "norm", "transformer.ln_f.bias": "norm",
        "lm_head.weight": "head",
    },
    "mlp": {
        "layers.0.weight": "hidden", "layers.0.bias": "bias",
        "layers.1.weight": "hidden", "layers.1.bias": "bias",
        "head.weight": "head", "head.bias": "bias",
    },
    "cnn": {
        "features.0.weight": "hidden", "features.0.bias": "bias",
        "features.1.weight": "norm", "features.1.bias": "norm",
        "features.3.weight": "hidden", "features.3.bias": "bias",
        "features.4.weight": "norm", "features.4.bias": "norm",
        "features.7.weight": "hidden", "features.7.bias": "bias",
        "features.8.weight": "norm", "features.8.bias": "norm",
        "head.weight": "head", "head.bias": "bias",
    },
}

# tied tensors: the other names of one tensor (every name must be accounted for)
ALIASES = {
    "hf-gpt2": {"transformer.wte.weight": ("lm_head.weight",)},
    "t5": {"shared.weight": ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight")},
}

# structure (what an ``auto`` view reads); every tensor not named here has none
STRUCTURES = {
    # Conv1D c_attn (32, 96): q, k, v along the 96 outputs
    "hf-gpt2": _layers("transformer.h.{i}.", 2, {"attn.c_attn.weight": {"batch": 0, "blocks": [32, 32, 32]}}),
    "qwen2-moe": _layers("model.layers.{i}.", 2, {
        "mlp.experts.gate_up_proj": {"batch": 1, "blocks": 2},
        "mlp.experts.down_proj": {"batch": 1},
    }),
    "mixtral": _layers("model.layers.{i}.", 2, {
        "mlp.experts.gate_up_proj": {"batch": 1, "blocks": 2},
        "mlp.experts.down_proj": {"batch": 1},
    }),
    # nn.MultiheadAttention's in_proj_weight (96, 32): three equal blocks
    "transformer-encoder": _layers("encoder.layers.{i}.", 2, {
        "self_attn.in_proj_weight": {"batch": 0, "blocks": [32, 32, 32]},
    }),
    "gpt": _layers("transformer.h.{i}.", 2, {"attn.c_attn.weight": {"batch": 0, "blocks": [64, 64, 64]}}),
}

# the matrices a spectral rule's ``auto`` view makes of the structured tensors (describe());
# every other spectral tensor is one plain matrix (no view)
VIEWS = {
    "hf-gpt2": _layers("transformer.h.{i}.", 2, {"attn.c_attn.weight": "3 × 32×32"}),
    "qwen2-moe": _layers("model.layers.{i}.", 2, {
        "mlp.experts.gate_up_proj": "8 × 24×32",  # 4 experts × (gate, up), each 24×32
        "mlp.experts.down_proj": "4 × 32×24",
    }),
    "mixtral": _layers("model.layers.{i}.", 2, {
        "mlp.experts.gate_up_proj": "8 × 32×16",
        "mlp.experts.down_proj": "4 × 16×32",
    }),
    "transformer-encoder": _layers("encoder.layers.{i}.", 2, {"self_attn.in_proj_weight": "3 × 32×32"}),
    "gpt": _layers("transformer.h.{i}.", 2, {"attn.c_attn.weight": "3 × 64×64"}),
}


def test_tables_are_self_consistent():
    assert set(ROLES) == set(ARCHS)
    for arch in ARCHS:
        assert set(STRUCTURES.get(arch, {})) <= set(ROLES[arch]), arch
        assert set(VIEWS.get(arch, {})) == set(STRUCTURES.get(arch, {})), arch
        assert set(ALIASES.get(arch, {})) <= set(ROLES[arch]), arch


# ---------------------------------------------------------------- roles, tensor by tensor


@pytest.mark.parametrize("arch", ARCHS)
def test_roles_match_the_table(arch):
    model = build(arch)
    infos, _ = model_params(model)
    expected = ROLES[arch]
    got = {p.name: p.role.name for p in infos}
    # the table names every tensor, and only tensors of the model
    assert sorted(set(got) - set(expected)) == [], "tensors missing from the table"
    assert sorted(set(expected) - set(got)) == [], "table entries that are not tensors of the model"
    wrong = {n: (expected[n], got[n]) for n in expected if got[n] != expected[n]}
    assert wrong == {}, "tensor: (expected, inferred)"
    assert all(not p.role.guessed for p in infos)
    assert {p.role.basis for p in infos} == {"trace"}, {p.role.untraced for p in infos}  # decided by use
    # every name of every tensor is accounted for (tied tensors: one entry, its aliases listed)
    assert {p.name: p.aliases for p in infos if p.aliases} == ALIASES.get(arch, {})
    every_name = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    assert every_name == set(expected) | {a for names in ALIASES.get(arch, {}).values() for a in names}


@pytest.mark.parametrize("arch", ARCHS)
def test_structures_match_the_table(arch):
    infos, _ = model_params(build(arch))
    expected = STRUCTURES.get(arch, {})
    got = {p.name: p.role.structure for p in infos if p.role.structure is not None}
    assert got == expected


# ---------------------------------------------------------------- shipped specs route by role


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("spec_name", SPECTRAL_SPECS)
def test_spectral_specs_route_by_role(spec_name, arch):
    model = build(arch)
    spec = geomopt.load_spec(ROOT / "specs" / f"{spec_name}.yaml")
    spectral_rules = [r.name for r in spec.rules if r.geometry.kind == "spectral"]
    assert spectral_rules == ["hidden"]
    plan = compile_spec(spec, model)
    roles = ROLES[arch]
    assert {p.name for p in plan} == set(roles)
    views = VIEWS.get(arch, {})
    n_spectral = 0
    for pp in plan:
        role_set = set(pp.role.split("+"))
        assert pp.role == roles[pp.name], pp.name
        kind = pp.geometry["kind"]
        if role_set & NOT_SPECTRAL:
            # (a) embeddings, heads, routers, norms, biases: never spectral
            assert kind != "spectral", f"{pp.name} ({pp.role}) routed to {pp.rule} ({kind})"
            continue
        assert role_set <= SPECTRAL, f"{pp.name}: unexpected role {pp.role}"
        # (b) hidden and expert matrices: spectral
        assert kind == "spectral" and pp.rule == "hidden", f"{pp.name} ({pp.role}) routed to {pp.rule} ({kind})"
        n_spectral += 1
        view = pp.geometry["view"]
        if pp.name in views:
            # (c) E matrices per batched expert weight, one matrix per block of a fused projection
            assert describe(view, pp.op_shape) == views[pp.name], pp.name
            if "expert" in role_set:
                assert view["batch"] == 1, pp.name
        else:
            assert view is None, f"{pp.name}: a plain matrix, got view {view}"
    assert n_spectral == sum(r in ("hidden", "expert") for r in roles.values()) > 0


def test_fused_projection_views_cut_the_right_rows():
    """The blocks are along the outputs in the operators' layout: GPT-2's Conv1D c_attn is (in, out)
    and transposed for the operators, the built-in gpt's (out, in) is not."""
    hf = compile_spec(ROOT / "specs" / "muon.yaml", build("hf-gpt2"))["transformer.h.0.attn.c_attn.weight"]
    ours = compile_spec(ROOT / "specs" / "muon.yaml", build("gpt"))["transformer.h.0.attn.c_attn.weight"]
    assert hf.shape == (32, 96) and hf.transpose and hf.op_shape == (96, 32)
    assert hf.geometry.view.blocks == (32, 32, 32)
    assert ours.shape == (192, 64) and not ours.transpose
    assert ours.geometry.view.blocks == (64, 64, 64)
    mha = compile_spec(ROOT / "specs" / "muon.yaml", build("transformer-encoder"))
    mha = mha["encoder.layers.0.self_attn.in_proj_weight"]
    assert mha.shape == (96, 32) and mha.geometry.view.blocks == (32, 32, 32)


# ---------------------------------------------------------------- one Muon step on Mixtral's experts

MUON_ABC = (3.4445, -4.7750, 2.0315)


def _muon_newton_schulz(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Muon's quintic Newton–Schulz in float32, written out, on each matrix of a (N, m, n) stack on
    its own: X/max(‖X‖_F, 1e-7), transposed when tall, X ← aX + (bA + cA²)X with A = XXᵀ."""
    a, b, c = MUON_ABC
    x = g.float()
    x = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=1e-7)
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if tall else x


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_muon_step_orthogonalizes_each_expert_and_each_gate_up_half():
    transformers = _transformers()
    torch.manual_seed(0)
    hidden, inter, n_experts = 16, 32, 4
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=64, hidden_size=hidden, intermediate_size=inter, num_local_experts=n_experts,
        num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=16))
    spec = geomopt.load_spec(ROOT / "specs" / "muon.yaml").model_dump()
    (rule,) = [r for r in spec["rules"] if r["name"] == "hidden"]
    rule["geometry"]["approx"]["dtype"] = "float32"  # Newton–Schulz in fp32 (muon.yaml: bf16)
    opt = geomopt.GeomOptimizer(model, spec)
    pp = opt.plan["model.layers.0.mlp.experts.gate_up_proj"]
    lr, wd, direction = pp.lr, pp.weight_decay, pp.direction
    assert (pp.rule, lr, wd) == ("hidden", 0.02, 0.1)  # muon.yaml's defaults
    assert pp.geometry["approx"]["dtype"] == "float32" and pp.geometry["scale"] == "muon_original"
    assert direction.model_dump() == {"kind": "polyak", "alpha": 0.05, "nesterov": True, "init": "zero",
                         "warmup_steps": 0, "warmup_alpha": None}

    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    model(input_ids=idx, labels=idx).loss.backward()
    experts = model.model.layers[0].mlp.experts
    w = {n: getattr(experts, n).detach().clone() for n in ("gate_up_proj", "down_proj")}
    g = {n: getattr(experts, n).grad.detach().clone() for n in ("gate_up_proj", "down_proj")}
    assert w["gate_up_proj"].shape == (n_experts, 2 * inter, hidden)
    assert w["down_proj"].shape == (n_experts, hidden, inter)
    opt.step()
    update = {n: getattr(experts, n).detach() - w[n] for n in w}

    def direction_of(grad):
        """geomopt.optim.units.directions.polyak on step 1, init zero: buf = 0.lerp(g, α) = αg, and with
        Nesterov d = g.lerp(buf, 1 − α) (torch.optim.Muon's convention)."""
        alpha = direction["alpha"]
        buf = torch.zeros_like(grad).lerp_(grad, alpha)
        return grad.lerp(buf, 1 - alpha)

    def muon_update(x, d):
        """The batched step on a (N, rows, cols) stack of matrices, each its own: X(1 − lr·wd) −
        lr·ρ·NS(d), ρ = √max(1, dout/din) of the matrix NS acts on."""
        rho = math.sqrt(max(1.0, x.shape[-2] / x.shape[-1]))
        return -lr * wd * x - lr * rho * _muon_newton_schulz(d)

    d_gu, d_down = direction_of(g["gate_up_proj"]), direction_of(g["down_proj"])
    # expert e's gate half is rows [0, I) of gate_up_proj[e], its up half rows [I, 2I): 2E matrices
    halves = (n_experts * 2, inter, hidden)
    per_half = muon_update(w["gate_up_proj"].reshape(halves), d_gu.reshape(halves)).reshape(w["gate_up_proj"].shape)
    per_expert_down = muon_update(w["down_proj"], d_down)
    for e in range(n_experts):
        for half in (slice(0, inter), slice(inter, 2 * inter)):  # gate, then up
            assert g["gate_up_proj"][e, half].norm() > 0, f"expert {e} got no gradient"
            assert _rel(update["gate_up_proj"][e, half], per_half[e, half]) <= 1e-4, (e, half)
        assert _rel(update["down_proj"][e], per_expert_down[e]) <= 1e-4, e

    # the test can fail: orthogonalizing the whole 4 × (64·16) matrix, or each expert's gate and up
    # together (64×16, ρ = 2), gives a different update
    flat = muon_update(w["gate_up_proj"].reshape(1, n_experts, -1), d_gu.reshape(1, n_experts, -1))
    assert _rel(update["gate_up_proj"], flat.reshape(w["gate_up_proj"].shape)) > 0.1
    joint = muon_update(w["gate_up_proj"], d_gu)
    for e in range(n_experts):
        assert _rel(update["gate_up_proj"][e], joint[e]) > 0.1, e


ALL_SPECS = sorted(p.stem for p in (ROOT / "specs").glob("*.yaml"))


def spec_findings(spec_name: str, model) -> list[str]:
    """The errors and warnings (notes left out) of shipped spec ``spec_name`` linted against ``model``."""
    spec = geomopt.load_spec(ROOT / "specs" / f"{spec_name}.yaml")
    return [d.format() for d in lint_spec(spec, model_params(model)[0]) if d.severity != "note"]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("spec_name", ALL_SPECS)
def test_shipped_specs_lint_clean(spec_name, arch):
    """No error and no warning for any shipped spec on any architecture: idle role rules (a model
    without embeddings or experts) are notes, and so is the adam geometry outside the theory."""
    spec = geomopt.load_spec(ROOT / "specs" / f"{spec_name}.yaml")
    diags = lint_spec(spec, model_params(build(arch))[0])
    assert [d.format() for d in diags if d.severity != "note"] == []
    assert {d.code for d in diags} <= {"GO109", "GO111", "GO113", "GO125"}


@pytest.mark.parametrize("arch", ARCHS)
def test_checkpoint_guesses_split_spectral_from_non_spectral_like_the_model(arch):
    """From names and shapes alone (a checkpoint's state dict), every tensor's guessed role falls
    on the same side of the spectral line as the role inferred from the model; the roles
    themselves agree except where only the module tree can tell (a tied head, a BatchNorm bias
    named like any bias). Structures (experts, gate/up halves) are guessed too."""
    from geomopt.compile.match import ParamInfo
    from geomopt.compile.roles.guess import guess_roles

    model = build(arch)
    infos = [ParamInfo(n, tuple(t.shape)) for n, t in model.state_dict().items() if t.is_floating_point()]
    guessed = guess_roles(infos)
    table = ROLES[arch]
    aliases = {a: n for n, names in ALIASES.get(arch, {}).items() for a in names}
    differ = []
    for p in infos:
        if aliases.get(p.name, p.name) not in table:
            continue  # a buffer (BatchNorm's running statistics): no parameter, no plan
        want = set(table[aliases.get(p.name, p.name)].split("+"))
        got = guessed[p.name]
        assert got.guessed and "guessed" in got.evidence
        assert bool(want & SPECTRAL) == bool(set(got.roles) & SPECTRAL), (p.name, want, got.roles)
        if not set(got.roles) <= want:
            differ.append((p.name, sorted(want), got.roles))
    assert all(set(w) <= {"norm", "bias", "embedding", "head"} and set(g) <= {"norm", "bias", "embedding", "head"}
               for _, w, g in differ), differ
    if arch in ("mixtral", "qwen2-moe"):
        up = next(p for p in infos if p.name.endswith("experts.gate_up_proj"))
        assert guessed[up.name].structure == {"batch": 1, "blocks": 2}


# ---------------------------------------------------------------- more architectures, spot checks

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2)
MORE = {
    "phi3": lambda t: t.Phi3ForCausalLM(t.Phi3Config(**SMALL, pad_token_id=0)),
    "olmoe": lambda t: t.OlmoeForCausalLM(t.OlmoeConfig(**SMALL, num_experts=4, num_experts_per_tok=2)),
    "qwen3-moe": lambda t: t.Qwen3MoeForCausalLM(t.Qwen3MoeConfig(**SMALL, num_experts=4, num_experts_per_tok=2,
                                                                   moe_intermediate_size=32)),
    "gpt-oss": lambda t: t.GptOssForCausalLM(t.GptOssConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2,
                                                             head_dim=16)),
    "deepseek-v3": lambda t: t.DeepseekV3ForCausalLM(t.DeepseekV3Config(
        **SMALL, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
        first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=16, n_group=1, topk_group=1)),
}
# (tensor, view description under muon.yaml, radius under muon.yaml's √max(1, dout/din))
SPOT = {
    "phi3": [("model.layers.0.self_attn.qkv_proj.weight", "64×64 + 2 × 32×64", 1.0),  # GQA: q, k, v unequal
             ("model.layers.0.mlp.gate_up_proj.weight", "2 × 96×64", math.sqrt(96 / 64))],
    "olmoe": [("model.layers.0.mlp.experts.gate_up_proj", "8 × 96×64", math.sqrt(96 / 64)),
              ("model.layers.0.mlp.experts.down_proj", "4 × 64×96", 1.0)],
    "qwen3-moe": [("model.layers.0.mlp.experts.gate_up_proj", "8 × 32×64", 1.0)],
    # stored (E, in, out) with gate and up interleaved: whole experts, the preset read transposed
    "gpt-oss": [("model.layers.0.mlp.experts.gate_up_proj", "4 × 64×192", math.sqrt(192 / 64)),
                ("model.layers.0.mlp.experts.down_proj", "4 × 96×64", 1.0)],
    # multi-head latent attention: no fused q, k, v anywhere (its layers only happen to have such sizes)
    "deepseek-v3": [("model.layers.0.self_attn.o_proj.weight", "64×64", 1.0),
                    ("model.layers.0.self_attn.q_b_proj.weight", "64×24", math.sqrt(64 / 24)),
                    ("model.layers.0.mlp.experts.gate_up_proj", "8 × 32×64", 1.0)],
}


@pytest.mark.parametrize("arch", list(MORE))
def test_more_architectures_route_and_view_right(arch):
    t = _transformers()
    torch.manual_seed(0)
    model = MORE[arch](t)
    plan = compile_spec(ROOT / "specs" / "muon.yaml", model)
    for pp in plan:
        roles = set(pp.role.split("+"))
        spectral = pp.geometry["kind"] == "spectral"
        assert spectral == bool(roles & SPECTRAL) and not (spectral and roles & NOT_SPECTRAL), (pp.name, pp.role)
    routers = [pp.name for pp in plan if pp.role == "router"]
    assert (len(routers) == 1) == (arch != "phi3"), routers
    for name, view, radius in SPOT[arch]:
        pp = plan[name]
        assert describe(pp.geometry["view"], pp.op_shape) == view, name
        assert pp.radius == pytest.approx(radius), name
    diags = lint_spec(geomopt.load_spec(ROOT / "specs" / "muon.yaml"), model_params(model)[0])
    assert [d.format() for d in diags if d.severity != "note"] == []
