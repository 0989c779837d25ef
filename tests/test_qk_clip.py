"""QK-clip (issue #31 item 1; Kimi K2, arXiv 2507.20534 §2.1): the spec field, the attention monitor
(geomopt/monitor.py) and the clip after the step (geomopt/optim/engine/qkclip.py).

Checked against float64 transcriptions (the logits from q and k captured independently; the report's
per-head rescaling) and against pytorch-optimizer's ``MuonClip`` on the same weights and logits, on
geomopt's GPT (fused c_attn, SDPA) and Hugging Face Llama (q_proj/k_proj, eager and sdpa attention,
grouped-query) and GPT-2 (Conv1D c_attn).
"""

from __future__ import annotations

import copy
import json
import math
import os

import pytest
import torch
import torch.nn.functional as F

from geomopt.compile.fragments import plain
import geomopt
from geomopt.models import GPT, GPTConfig
from geomopt.monitor import attention_sites, sdpa_head_max
from geomopt.optim.engine.qkclip import clip_site
from geomopt.spec.schema import schema

import catalog_mla

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

GPT_SPEC = """geomopt 1
name "gpt-clip"
rule qk match "**.attn.c_attn.weight":
    geometry spectral(indicator, approx=newton_schulz(), view=auto)
    lr=0.02
    qk_clip=max_logit(tau={tau})
rule rest match "**":
    geometry adam
    lr=0.001
"""

LLAMA_SPEC = GPT_SPEC.replace('"**.attn.c_attn.weight"', '"re:.*\\\\.(q_proj|k_proj)\\\\.weight"')


def gpt(scale: float = 1.0) -> GPT:
    torch.manual_seed(0)
    m = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16))
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "c_attn" in n:
                p.mul_(scale)
    return m


def llama(attn: str = "sdpa", kv: int = 2, scale: float = 1.0):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=kv, max_position_embeddings=32,
                                   attn_implementation=attn)
    m = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "q_proj" in n or "k_proj" in n:
                p.mul_(scale)
    m.train()
    return m


def gpt2(attn: str = "sdpa", scale: float = 1.0):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                                  attn_implementation=attn, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    m = transformers.GPT2LMHeadModel(cfg)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "c_attn" in n:
                p.mul_(scale)
    m.train()
    return m


def loss(model, step: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    if isinstance(model, GPT):
        idx = torch.randint(0, 32, (4, 8), generator=g)
        return model(idx, idx)[1]
    ids = torch.randint(0, 64, (3, 12), generator=g)
    return model(input_ids=ids, labels=ids).loss


# ---------------------------------------------------------------- float64 references


def _causal_max(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """max over batch and causal (i ≥ j) positions of q_i·k_j·scale per head; q, k (B, H, T, d), float64."""
    s = torch.einsum("bhid,bhjd->bhij", q.double(), k.double()) * scale
    t = s.shape[-1]
    s = s.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), -math.inf)
    return s.amax(dim=(0, 2, 3))


def _capture(out: dict, name: str, heads: int):
    """A forward hook on a fused c_attn: out[name] = the float64 causal max logits of its q and k."""
    def hook(m, args, y):
        b, t, e3 = y.shape
        q, k, _ = y.detach().double().split(e3 // 3, dim=2)
        q, k = (z.view(b, t, heads, -1).transpose(1, 2) for z in (q, k))
        out[name] = _causal_max(q, k, q.shape[-1] ** -0.5)
    return hook


def gpt_reference_maxima(model: GPT, step: int = 0) -> dict:
    """Per attention module, the float64 max logits from its c_attn output (captured by a hook)."""
    out, handles = {}, []
    for name, mod in model.named_modules():
        if name.endswith("attn.c_attn"):
            handles.append(mod.register_forward_hook(_capture(out, name.rpartition(".")[0], heads=2)))
    loss(model, step)
    for hd in handles:
        hd.remove()
    return out


def report_clip(weights: dict, maxima: torch.Tensor, tau: float, alpha: float, heads: int, kv: int, d: int) -> dict:
    """The report's QK-clip in float64, head by head: for each head h with S_h > τ, η = τ / S_h,
    W_q^h ← η^α W_q^h, W_k^h ← η^(1−α) W_k^h (a key head shared by a group: the group's smallest η)."""
    wq, wk = weights["q"].double().clone(), weights["k"].double().clone()
    group = heads // kv
    for h in range(heads):
        s = float(maxima[h])
        if s > tau:
            wq[h * d:(h + 1) * d] *= (tau / s) ** alpha
    for j in range(kv):
        s = max(float(maxima[h]) for h in range(j * group, (j + 1) * group))
        if s > tau:
            wk[j * d:(j + 1) * d] *= (tau / s) ** (1 - alpha)
    return {"q": wq, "k": wk}


# ---------------------------------------------------------------- the spec


def test_spec_field_round_trips_and_is_in_the_schema():
    spec = geomopt.parse_spec(GPT_SPEC.format(tau=100), "dsl")
    assert spec.rules[0].qk_clip.model_dump() == {"kind": "max_logit", "tau": 100.0, "alpha": 0.5}
    for fmt in ("yaml", "dsl"):
        assert geomopt.parse_spec(geomopt.dump_spec(spec, fmt), fmt) == spec
    text = geomopt.dump_spec(spec, "yaml")
    assert "qk_clip: {kind: max_logit, tau: 100.0}" in text
    yaml = text.replace("{kind: max_logit, tau: 100.0}", "{tau: 100}")  # kind defaults
    assert geomopt.parse_spec(yaml, "yaml") == spec
    rule = schema()["$defs"]["Rule"]["properties"]
    assert "qk_clip" in rule
    assert "qk_clip" in json.loads(open("schema/geomopt-1.schema.json").read())["$defs"]["Rule"]["properties"]


@pytest.mark.parametrize("bad, what", [("tau=0", "tau"), ("tau=-1", "tau"), ("tau=1, alpha=1.5", "alpha"),
                                       ("tau=1, beta=2", "beta")])
def test_spec_field_is_validated(bad, what):
    with pytest.raises(geomopt.SpecError, match=what):
        geomopt.parse_spec(GPT_SPEC.replace("tau={tau}", bad), "dsl")


def test_lint_reads_a_qk_clip_spec():
    from geomopt.lint.runner import lint_spec

    spec = geomopt.parse_spec(GPT_SPEC.format(tau=100), "dsl")
    assert not [d for d in lint_spec(spec) if d.severity == "error"]


def test_plan_carries_the_clip():
    plan = geomopt.compile_spec(geomopt.parse_spec(GPT_SPEC.format(tau=3), "dsl"), gpt())
    assert plain(plan["transformer.h.0.attn.c_attn.weight"].qk_clip) == {"kind": "max_logit", "tau": 3.0, "alpha": 0.5}
    assert plan["transformer.h.0.attn.c_proj.weight"].qk_clip is None


# ---------------------------------------------------------------- the monitor


@pytest.mark.parametrize("case", ["causal", "bool", "float", "gqa", "scale", "unbatched"])
def test_sdpa_head_max_is_the_masked_max_logit(case):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 5, 8, generator=g) * 3 for _ in range(3))
    kw: dict = {}
    mask = torch.ones(5, 5, dtype=torch.bool)
    if case == "causal":
        kw["is_causal"] = True
        mask = mask.tril()
    elif case == "bool":
        mask = torch.rand(2, 1, 5, 5, generator=g) > 0.3
        mask[..., 0] = True
        kw["attn_mask"] = mask
    elif case == "float":
        kw["attn_mask"] = torch.where(mask.tril(), 0.0, -math.inf)
        mask = mask.tril()
    elif case == "gqa":
        k, v = k[:, :2], v[:, :2]
        kw["enable_gqa"] = True
    elif case == "scale":
        kw["scale"] = 0.3
    kk = k.repeat_interleave(2, dim=1) if case == "gqa" else k
    s = torch.einsum("bhid,bhjd->bhij", q.double(), kk.double()) * kw.get("scale", 8 ** -0.5)
    ref = s.masked_fill(~mask, -math.inf).amax(dim=(0, 2, 3))
    if case == "unbatched":
        q, k, v = q[0], k[0], v[0]
        ref = s[:1].amax(dim=(0, 2, 3))
    got = sdpa_head_max(q, k, v, **kw)
    assert got.shape == (4,)
    assert (got.double() - ref).abs().max() < 1e-5 * ref.abs().max()


def test_monitor_matches_a_float64_capture_on_gpt():
    model = gpt(scale=4.0)
    ref = gpt_reference_maxima(copy.deepcopy(model))
    handle = geomopt.monitor_attention(model)
    loss(model)
    got = handle.maxima()
    handle.remove()
    assert set(got) == set(ref) == {"transformer.h.0.attn", "transformer.h.1.attn"}
    worst = max(float((got[n].double() - ref[n]).abs().max() / ref[n].abs().max()) for n in ref)
    assert worst < 1e-6
    with torch.no_grad():  # removed: nothing more is recorded
        loss(model)


def test_monitor_counts_training_forwards_only_and_accumulates():
    model = gpt(scale=4.0)
    handle = geomopt.monitor_attention(model)
    with torch.no_grad():
        loss(model)
    assert handle.maxima() == {}
    loss(model, 0)
    first = {n: m.clone() for n, m in handle.maxima().items()}
    loss(model, 1)
    r1 = gpt_reference_maxima(copy.deepcopy(model), 1)
    for n, m in handle.maxima().items():
        assert torch.equal(m, torch.maximum(first[n], r1[n].float())) or (m.double() - torch.maximum(
            first[n].double(), r1[n])).abs().max() < 1e-5
    handle.remove()
    assert not handle._handles


@pytest.mark.parametrize("make", [lambda a: llama(a, kv=2, scale=3.0), lambda a: llama(a, kv=4, scale=3.0),
                                  lambda a: gpt2(a, scale=3.0)], ids=["llama-gqa", "llama-mha", "gpt2"])
def test_monitor_sees_the_same_logits_under_eager_and_sdpa(make):
    maxima = {}
    for attn in ("eager", "sdpa"):
        model = make(attn)
        handle = geomopt.monitor_attention(model)
        loss(model)
        maxima[attn] = handle.maxima()
        handle.remove()
    assert set(maxima["eager"]) == set(maxima["sdpa"]) and len(maxima["eager"]) == 2
    for n, m in maxima["eager"].items():
        assert (m - maxima["sdpa"][n]).abs().max() <= 1e-5 * m.abs().max(), n


def test_monitor_matches_a_float64_capture_on_hf_gpt2():
    model = gpt2("sdpa", scale=3.0)
    ref, handles = {}, []
    for name, mod in model.named_modules():
        if name.endswith("attn.c_attn"):
            handles.append(mod.register_forward_hook(_capture(ref, name.rpartition(".")[0], heads=4)))
    handle = geomopt.monitor_attention(model)
    loss(model)
    got = handle.maxima()
    handle.remove()
    assert set(got) == set(ref)
    assert max(float((got[n].double() - ref[n]).abs().max() / ref[n].abs().max()) for n in ref) < 1e-6


# ---------------------------------------------------------------- the clip


def _llama_site(model, index: int = 0):
    sites, _ = attention_sites(model)
    return sites[index]


@pytest.mark.parametrize("kv", [4, 2])
def test_clip_matches_the_report_in_float64(kv):
    model = llama("sdpa", kv=kv)
    site = _llama_site(model)
    attn = site.module
    before = {"q": attn.q_proj.weight.detach().clone(), "k": attn.k_proj.weight.detach().clone()}
    maxima = torch.tensor([250.0, 40.0, 100.5, 1e4])
    clip_site(site, maxima, 100.0, 0.5)
    ref = report_clip(before, maxima, 100.0, 0.5, 4, kv, 8)
    assert (attn.q_proj.weight.double() - ref["q"]).abs().max() <= 1e-7 * ref["q"].abs().max()
    assert (attn.k_proj.weight.double() - ref["k"]).abs().max() <= 1e-7 * ref["k"].abs().max()
    assert torch.equal(attn.q_proj.weight[8:16], before["q"][8:16])  # head 1 under τ: untouched bit for bit


def test_clip_matches_pytorch_optimizer_muonclip():
    po = pytest.importorskip("pytorch_optimizer")
    model = llama("sdpa", kv=4)
    site = _llama_site(model)
    attn = site.module
    wq, wk = attn.q_proj.weight.detach().clone(), attn.k_proj.weight.detach().clone()
    maxima = torch.tensor([250.0, 40.0, 100.5, 1e4])
    pq, pk = torch.nn.Parameter(wq.clone()), torch.nn.Parameter(wk.clone())
    for p in (pq, pk):
        p.grad = torch.zeros_like(p)
    ref = po.MuonClip([dict(params=[pq], use_muon=True, lr=0.0, qk_clip="query", attention_name="a"),
                       dict(params=[pk], use_muon=True, lr=0.0, qk_clip="key", attention_name="a")],
                      qk_clip_threshold=100.0, qk_clip_alpha=0.5, weight_decay=0.0)
    ref.step(attention_max_logits={"a": maxima})
    clip_site(site, maxima, 100.0, 0.5)
    assert (attn.q_proj.weight - pq).abs().max() <= 1e-7 * pq.abs().max()
    assert (attn.k_proj.weight - pk).abs().max() <= 1e-7 * pk.abs().max()
    assert not torch.equal(pq, wq)


@pytest.mark.parametrize("make, spec", [(lambda: gpt(scale=6.0), GPT_SPEC),
                                        (lambda: llama("eager", kv=4, scale=4.0), LLAMA_SPEC),
                                        (lambda: llama("sdpa", kv=2, scale=4.0), LLAMA_SPEC),
                                        (lambda: gpt2("sdpa", scale=4.0), GPT_SPEC)],
                         ids=["gpt", "llama-eager-mha", "llama-sdpa-gqa", "gpt2"])
def test_step_is_the_plain_step_then_the_report_clip(make, spec):
    """geomopt with qk_clip == geomopt without it, then the float64 report clip on the monitor's
    logits (of the forward before the update, as in the report), over two steps."""
    model = make()
    plain = copy.deepcopy(model)
    handle = geomopt.monitor_attention(model)
    tau, opt, ref = 0.0, None, None
    for step in range(2):
        for m in (model, plain):
            m.zero_grad(set_to_none=True)
            loss(m, step).backward()
        S0 = {n: m.clone() for n, m in handle.maxima().items()}
        if opt is None:  # τ under every module's largest logit: each clips some heads
            tau = float(min(m.max() for m in S0.values())) * 0.8
            opt = geomopt.GeomOptimizer(model, spec.format(tau=tau))
            ref = geomopt.GeomOptimizer(plain, spec.format(tau=tau).replace(f"    qk_clip=max_logit(tau={tau})\n", ""))
        opt.step()
        ref.step()
        assert handle.maxima() == {}  # consumed by the clip
        for site in attention_sites(plain)[0]:
            fused = site.weights[0].endswith("c_attn.weight")
            conv1d = fused and type(site.module.c_attn).__name__ == "Conv1D"
            e, kvd = site.heads * site.head_dim, site.kv_heads * site.head_dim
            own = dict(model.named_parameters())
            for pname, (p, parts) in site.tensors.items():
                x = p.detach().double()
                x = x.T if conv1d and x.ndim == 2 else x
                if fused:
                    w = {"q": x[:e], "k": x[e:e + kvd]}
                else:
                    w = {parts[0].kind: x, "qk"[parts[0].kind == "q"]: x}  # one part per tensor
                want = report_clip(w, S0[site.name].double(), tau, 0.5, site.heads, site.kv_heads, site.head_dim)
                got = own[pname].detach().double()
                got = got.T if conv1d and got.ndim == 2 else got
                if fused:
                    want = torch.cat([want["q"], want["k"], x[e + kvd:]])
                else:
                    want = want[parts[0].kind]
                assert (got - want).abs().max() <= 1e-6 * want.abs().max(), pname
            with torch.no_grad():
                for pname, (p, _) in site.tensors.items():
                    p.copy_(own[pname])
    handle.remove()


@pytest.mark.parametrize("make", [lambda: gpt(scale=6.0), lambda: llama("eager", kv=4, scale=4.0),
                                  lambda: llama("sdpa", kv=2, scale=4.0), lambda: gpt2("eager", scale=4.0)],
                         ids=["gpt", "llama-eager-mha", "llama-sdpa-gqa", "gpt2-eager"])
def test_clipped_weights_bring_the_same_batch_to_tau(make):
    """Clip on one forward's logits, run the same batch again: every head of the first layer (whose
    inputs the clip does not change) at most τ, and under multi-head attention each clipped head at
    exactly τ (its logits all scale by η_h)."""
    model = make()
    handle = geomopt.monitor_attention(model)
    loss(model)
    before = {s.name: s.maxima.clone() for s in handle.sites}
    tau = float(min(m.max() for m in before.values())) * 0.7
    for site in handle.sites:
        clip_site(site, site.maxima, tau, 0.5)
    handle.reset()
    loss(model)
    for site in handle.sites[:1]:
        m, s0 = site.maxima, before[site.name]
        assert float(m.max()) <= tau * (1 + 1e-5)
        assert torch.allclose(m[s0 <= tau], s0[s0 <= tau], rtol=1e-5) or site.kv_heads < site.heads
        if site.kv_heads == site.heads:
            assert torch.allclose(m[s0 > tau], torch.full_like(m[s0 > tau], tau), rtol=1e-5)
    handle.remove()


# ---------------------------------------------------------------- multi-head latent attention


MLA_SPEC = LLAMA_SPEC.replace("(q_proj|k_proj)", "(q_b_proj|q_proj|kv_b_proj)")


def _mla_batch(model, step: int = 0):
    ids = torch.randint(0, 96, (3, 12), generator=torch.Generator().manual_seed(200 + step))
    return model(input_ids=ids, labels=ids).loss


@pytest.mark.parametrize("attn, overrides, mscale", [("sdpa", {}, 1.0), ("eager", {}, 1.0),
                                                     ("sdpa", {"q_lora_rank": None}, 1.0),
                                                     ("eager", {"rope_interleave": False}, 1.0),
                                                     ("sdpa", {}, 1.7), ("eager", {}, 1.7)],
                         ids=["sdpa", "eager", "no-query-lora", "rope-halves", "sdpa-own-scale", "eager-own-scale"])
def test_monitor_matches_mla_logits_written_out(attn, overrides, mscale):
    """The monitor's per-head maxima on DeepSeek-V3's MLA against the logits recomputed in float64
    from each module's weights and its captured input (tests/catalog_mla.py); with the modules'
    softmax scale changed (as YaRN's mscale² does), the monitor's maxima follow it."""
    model = catalog_mla.mla(attn, scale=20.0, **overrides)
    for layer in model.model.layers:
        layer.self_attn.scaling *= mscale
    handle, inputs = geomopt.monitor_attention(model), catalog_mla.Inputs(model)
    assert not handle.refused and [s.name for s in handle.sites] == list(inputs.modules)
    for step in range(2):  # the max over two training forwards
        _mla_batch(model, step)
    got, ref = handle.maxima(), inputs.maxima()
    handle.remove()
    inputs.remove()
    assert set(got) == set(ref) and len(ref) == 2
    for n in ref:
        assert got[n].shape == (4,)
        assert float(((got[n].double() - mscale * ref[n]) / ref[n]).abs().max()) < 1e-6, n


def _mla_parts(model, name: str) -> dict:
    """Head-first float64 copies of an MLA module's q_C, q_R, k_C, v rows and shared tensors."""
    a = model.get_submodule(name)
    cfg = a.config
    h, nope, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    q = (a.q_b_proj if cfg.q_lora_rank else a.q_proj).weight.detach()
    q = q.view(h, -1, q.shape[1])
    kv = a.kv_b_proj.weight.detach().view(h, nope + v, -1)
    out = {"q_C": q[:, :nope], "q_R": q[:, nope:], "k_C": kv[:, :nope], "v": kv[:, nope:],
           "kv_a": a.kv_a_proj_with_mqa.weight.detach()}
    if cfg.q_lora_rank:
        out["q_a"] = a.q_a_proj.weight.detach()
    return {k: t.clone() for k, t in out.items()}


@pytest.mark.parametrize("alpha, overrides", [(0.5, {}), (0.3, {"q_lora_rank": None})], ids=["report", "alpha-0.3"])
def test_mla_clip_brings_the_clipped_heads_to_tau_and_leaves_the_rest(alpha, overrides):
    """Clip on one forward's maxima, recompute the same batch's logits from the clipped weights
    (first layer: its input is unchanged): every clipped head's max at τ (q_C·k_C scaled by
    η^α·η^(1−α), q_R·k_R by η), the others where they were; the rows written are the report's
    (q_C × η^α, k_C × η^(1−α), q_R × η, in float64), and the rest — heads under τ, the value rows,
    the shared latents and rotary key k_R — bit for bit as they were."""
    model = catalog_mla.mla("sdpa", scale=20.0, **overrides)
    handle, inputs = geomopt.monitor_attention(model), catalog_mla.Inputs(model)
    _mla_batch(model)
    site = handle.sites[0]
    x = inputs.seen[site.name][0]
    s0 = catalog_mla.mla_logits(site.module, x).amax(dim=(0, 2, 3))
    tau = float(s0.sort().values[1])  # two heads above τ, one at it, one under
    before = _mla_parts(model, site.name)
    clip_site(site, site.maxima, tau, alpha)
    after = _mla_parts(model, site.name)
    s1 = catalog_mla.mla_logits(site.module, x).amax(dim=(0, 2, 3))
    handle.remove()
    inputs.remove()
    clipped = s0 > tau
    assert int(clipped.sum()) == 2
    assert torch.allclose(s1[clipped], torch.full_like(s1[clipped], tau), rtol=1e-5)
    assert torch.allclose(s1[~clipped], s0[~clipped], rtol=1e-6)
    eta = (tau / s0.clamp_min(tau)).view(-1, 1, 1)
    for key, power in (("q_C", alpha), ("k_C", 1 - alpha), ("q_R", 1.0)):
        want = before[key].double() * eta ** power
        assert (after[key].double() - want).abs().max() <= 1e-6 * want.abs().max(), key
        assert torch.equal(after[key][~clipped], before[key][~clipped]), key
        assert not torch.equal(after[key][clipped], before[key][clipped]), key
    for key in ("v", "kv_a", "q_a"):
        if key in before:
            assert torch.equal(after[key], before[key]), key


def test_mla_clip_matches_pytorch_optimizer_muonclip():
    """clip_site on MLA against pytorch-optimizer's MuonClip (lr 0) given the same maxima, its
    ``query``, ``query_rotary`` and ``key`` groups on the per-head parts (views into a copy)."""
    pytest.importorskip("pytorch_optimizer")
    from pytorch_optimizer import MuonClip

    model = catalog_mla.mla("sdpa", scale=20.0)
    twin = copy.deepcopy(model)
    site = attention_sites(model)[0][0]
    maxima = torch.tensor([250.0, 40.0, 100.5, 1e4])
    ref = MuonClip(catalog_mla.clip_groups(twin), qk_clip_threshold=100.0, qk_clip_alpha=0.5)
    ref.step(attention_max_logits={n: maxima for n, _ in twin.named_modules() if n.endswith("self_attn")})
    clip_site(site, maxima, 100.0, 0.5)
    own, theirs = dict(model.named_parameters()), dict(twin.named_parameters())
    moved = 0
    for n in site.tensors:
        assert (own[n] - theirs[n]).abs().max() <= 1e-7 * theirs[n].abs().max(), n
        moved += not torch.equal(theirs[n], catalog_mla.mla("sdpa", scale=20.0).get_parameter(n))
    assert moved == 2
    assert torch.equal(own[f"{site.name}.kv_a_proj_with_mqa.weight"], theirs[f"{site.name}.kv_a_proj_with_mqa.weight"])


def test_mla_step_clips_with_the_monitors_maxima():
    """A step with qk_clip on q_b_proj/kv_b_proj: the plain step, then the clip on the logits of
    the forward before it (as above), on both layers."""
    model = catalog_mla.mla("eager", scale=20.0)
    plain = copy.deepcopy(model)
    handle = geomopt.monitor_attention(model)
    for m in (model, plain):
        _mla_batch(m).backward()
    s0 = {n: m.clone() for n, m in handle.maxima().items()}
    tau = float(min(m.max() for m in s0.values())) * 0.8
    geomopt.GeomOptimizer(model, MLA_SPEC.format(tau=tau)).step()
    geomopt.GeomOptimizer(plain, MLA_SPEC.format(tau=tau).replace(f"    qk_clip=max_logit(tau={tau})\n", "")).step()
    handle.remove()
    unclipped = {n: p.detach().clone() for n, p in plain.named_parameters()}
    for site in attention_sites(plain)[0]:
        clip_site(site, s0[site.name], tau, 0.5)
    own = dict(model.named_parameters())
    changed = []
    for n, p in plain.named_parameters():
        assert (own[n].double() - p.double()).abs().max() <= 1e-6 * p.abs().max(), n
        if not torch.equal(p, unclipped[n]):
            changed.append(n.rpartition(".")[0].rpartition(".")[2])
    assert sorted(set(changed)) == ["kv_b_proj", "q_b_proj"] and len(changed) == 4  # both layers clip


@pytest.mark.parametrize("match, what", [("(q_b_proj|kv_b_proj|kv_a_proj_with_mqa)", "kv_a_proj_with_mqa.weight' gives "
                                          "the key-value latent and the rotary key k_R, shared by every head"),
                                         ("(q_b_proj|kv_b_proj|q_a_proj)", "q_a_proj.weight' gives the query latent"),
                                         ("q_b_proj", r"kv_b_proj\.weight' is in no rule")])
def test_mla_rules_on_shared_tensors_or_without_their_keys_are_refused(match, what):
    spec = LLAMA_SPEC.format(tau=1.0).replace("(q_proj|k_proj)", match)
    with pytest.raises(geomopt.SpecError, match=what):
        geomopt.GeomOptimizer(catalog_mla.mla(), spec)


@pytest.mark.filterwarnings("ignore::geomopt.RolesGuessedWarning")  # the broken modules' forward fails: no trace
@pytest.mark.parametrize("case, why", [
    ("no rotary dim", r"without stated head counts and dims \(num_heads, qk_nope_head_dim, qk_rope_head_dim"),
    ("rows", r"48 query rows and 64 kv_b_proj rows are not 4 heads of 6 \+ 4 \(query\) and 6 \+ 8"),
    ("not linear", r"without nn.Linear q_b_proj \(or q_proj\), kv_b_proj and kv_a_proj_with_mqa")])
def test_mla_the_monitor_cannot_read_is_refused_with_the_reason(case, why):
    model = catalog_mla.mla()
    for layer in model.model.layers:
        a = layer.self_attn
        if case == "no rotary dim":  # stated neither on the module nor in its config
            del a.qk_rope_head_dim
            a.config = type("Config", (), {"num_attention_heads": 4})()
        elif case == "rows":  # a stated dim its tensors do not have
            a.qk_nope_head_dim = 6
        else:
            a.kv_b_proj = torch.nn.Sequential(a.kv_b_proj)
    sites, refused = attention_sites(model)
    assert not sites and set(refused) == {"model.layers.0.self_attn", "model.layers.1.self_attn"}
    with pytest.raises(ValueError, match="multi-head latent attention \\(MLA\\).*" + why):
        geomopt.monitor_attention(model)
    with pytest.raises(geomopt.SpecError, match=r"q_b_proj\.weight' is not a query or key projection.*"
                                                r"multi-head latent attention"):
        geomopt.GeomOptimizer(model, MLA_SPEC.format(tau=1.0))


# ---------------------------------------------------------------- the guide and the benchmark


def test_the_guide_runs_and_its_spec_parses(tmp_path, monkeypatch):
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "guide" / "qk-clip.md").read_text(encoding="utf-8")
    yaml = re.search(r"```yaml\n(.*?)```", page, re.S).group(1)
    yaml = "\n".join(line[4:] for line in yaml.splitlines())  # the tab's indentation
    spec = geomopt.parse_spec(yaml, "yaml")
    assert spec.rules[0].qk_clip.tau == 100.0
    geomopt.GeomOptimizer(llama(kv=4), spec)  # the rule's tensors are Llama's q/k projections
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "qk_clip_guide"}
    for block in re.findall(r"^```python\n(.*?)^```", page, re.S | re.M):
        exec(compile(block, "docs/guide/qk-clip.md", "exec"), namespace)
    namespace["monitor"].remove()


def test_benchmark_script_writes_its_json(tmp_path):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "qk_monitor.py"
    spec = importlib.util.spec_from_file_location("bench_qk_monitor", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "qk.json"
    assert module.main(["--small", "--iters", "1", "--device", "cpu", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [r["workload"] for r in data["results"]] == ["gpt", "llama-sdpa", "llama-eager"]
    assert all(r["sites"] == 2 and r["ms"]["step + qk_clip"] > 0 for r in data["results"])


# ---------------------------------------------------------------- bad input


def test_no_monitor_raises_at_the_first_step_before_any_write():
    model = gpt(scale=6.0)
    opt = geomopt.GeomOptimizer(model, GPT_SPEC.format(tau=1.0))
    loss(model).backward()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(RuntimeError, match=r"no attention monitor watches 'transformer\.h\.0\.attn\.c_attn\.weight'"
                                           r".*geomopt\.monitor_attention\(model\)"):
        opt.step()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert all(not st for st in opt.state.values()) and all(g["step"] == 0 for g in opt.param_groups)
    handle = geomopt.monitor_attention(model)  # attached: the same step now runs
    loss(model).backward()
    opt.step()
    handle.remove()
    with pytest.raises(RuntimeError, match="monitor_attention"):  # detached again
        opt.step()


def test_a_copied_or_pickled_model_is_not_watched_until_a_monitor_is_attached():
    import io

    model = gpt(scale=4.0)
    opt = geomopt.GeomOptimizer(model, GPT_SPEC.format(tau=1.0))
    handle = geomopt.monitor_attention(model)
    twin, twin_opt = copy.deepcopy((model, opt))
    buf = io.BytesIO()
    torch.save({"model": model, "opt": opt}, buf)  # the monitor's hooks pickle (as no-ops)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)["model"]
    for m in (twin, loaded):
        with torch.no_grad():
            for n, p in m.named_parameters():
                if "c_attn" in n:
                    p.mul_(10.0)
        loss(m).backward()
    assert handle.maxima() == {}  # the copies' forwards are not the original's
    with pytest.raises(RuntimeError, match="monitor_attention"):
        twin_opt.step()
    own = geomopt.monitor_attention(twin)
    loss(twin).backward()
    twin_opt.step()
    own.remove()
    handle.remove()


def test_a_flash_kernel_the_monitor_cannot_see_is_refused_before_any_write(monkeypatch):
    """An attention module whose forward calls neither SDPA nor a softmax (a flash / flex kernel)."""
    model = gpt(scale=4.0)
    opt = geomopt.GeomOptimizer(model, GPT_SPEC.format(tau=1.0))
    handle = geomopt.monitor_attention(model)
    real = F.scaled_dot_product_attention

    def hidden_kernel(*args, **kwargs):  # as a C++ kernel: torch functions below the mode
        with torch.overrides._disable_user_modes() if hasattr(torch.overrides, "_disable_user_modes") else \
                torch._C.DisableTorchFunction():
            return real(*args, **kwargs)

    import geomopt.models.gpt as gpt_module

    monkeypatch.setattr(gpt_module.F, "scaled_dot_product_attention", hidden_kernel)
    loss(model).backward()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(RuntimeError, match=r"'transformer\.h\.0\.attn' ran 1 training forward.*attn_implementation"):
        opt.step()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    handle.remove()


def test_a_monitor_on_another_model_is_named_as_such():
    model, other = gpt(), gpt()
    opt = geomopt.GeomOptimizer(model, GPT_SPEC.format(tau=1.0))
    handle = geomopt.monitor_attention(other)
    loss(model).backward()
    with pytest.raises(RuntimeError, match="attach geomopt.monitor_attention to the model this optimizer steps"):
        opt.step()
    handle.remove()


def test_a_removed_monitor_no_longer_counts():
    model = gpt()
    geomopt.monitor_attention(model).remove()
    opt = geomopt.GeomOptimizer(model, GPT_SPEC.format(tau=1.0))
    loss(model).backward()
    with pytest.raises(RuntimeError, match="monitor_attention"):
        opt.step()


@pytest.mark.parametrize("match, tensor", [('name="**" ndim=2', "transformer.h.0."),
                                           ('"**.attn.c_proj.weight"', "transformer.h.0.attn.c_proj.weight"),
                                           ('"**.mlp.*.weight" "**.attn.c_attn.weight"', "transformer.h.0.mlp.c_fc")])
def test_a_clip_on_tensors_that_are_not_q_or_k_is_refused_at_construction(match, tensor):
    spec = GPT_SPEC.format(tau=1.0).replace('"**.attn.c_attn.weight"', match)
    if " " in match:
        spec = spec.replace(f'match {match}', 'match name="re:.*(mlp\\\\.c_fc|attn\\\\.c_attn)\\\\.weight"')
    with pytest.raises(ValueError, match=rf"rule 'qk' has qk_clip, but tensor '{tensor}.*' is not a query or key "
                                         r"projection"):
        geomopt.GeomOptimizer(gpt(), spec)


def test_a_clip_on_queries_without_their_keys_is_refused():
    spec = LLAMA_SPEC.format(tau=1.0).replace("(q_proj|k_proj)", "q_proj")
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.k_proj\.weight' is in no rule"):
        geomopt.GeomOptimizer(llama(), spec)


def test_monitor_on_a_model_without_attention_says_so():
    with pytest.raises(ValueError, match="no attention module"):
        geomopt.monitor_attention(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_sdpa_outside_a_monitored_module_is_not_counted():
    model = gpt()
    handle = geomopt.monitor_attention(model)
    q = torch.randn(1, 2, 3, 4, requires_grad=True)
    F.scaled_dot_product_attention(q, q, q)
    assert handle.maxima() == {}
    handle.remove()


# ---------------------------------------------------------------- two ranks


@pytest.mark.xdist_group("torchrun")  # one worker runs every torchrun launch (tests/conftest.py)
def test_two_ranks_clip_with_the_max_over_ranks(tmp_path):
    """Under torch.distributed the maxima are all-reduced (max) before the clip: both ranks end
    with the same weights, the plain step's followed by the report's clip on the larger logits."""
    import subprocess
    import sys
    from pathlib import Path

    worker = Path(__file__).with_name("qk_clip_worker.py")
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=str(worker.parents[1]) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(worker),
           str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for n, p in ranks[0]["clipped"].items():
        assert torch.equal(p, ranks[1]["clipped"][n]), n
    tau = ranks[0]["tau"]
    assert any(not torch.equal(ranks[0]["local"][n], ranks[1]["local"][n]) for n in ranks[0]["local"])
    for site_name in ranks[0]["local"]:
        s = torch.maximum(ranks[0]["local"][site_name], ranks[1]["local"][site_name]).double()
        for suffix in ("weight", "bias"):
            name = f"{site_name}.c_attn.{suffix}"
            x = ranks[0]["plain"][name].double()
            want = report_clip({"q": x[:16], "k": x[16:32]}, s, tau, 0.5, 2, 2, 8)
            want = torch.cat([want["q"], want["k"], x[32:]])
            got = ranks[0]["clipped"][name].double()
            assert (got - want).abs().max() <= 1e-6 * want.abs().max(), name
