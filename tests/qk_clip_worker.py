"""Two-rank QK-clip run for tests/test_qk_clip.py (``torchrun --standalone --nproc_per_node 2``, gloo).

Each rank: geomopt's GPT (same init), its own batch, the gradients averaged over the ranks (as DDP
does), one step of a QK-clip spec and of the same spec without the clip on a copy; saves the
weights, and its own logit maxima, to ``OUT/rank{r}.pt``. The clip must use the max over the ranks.
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist

import geomopt
from geomopt.models import GPT, GPTConfig

SPEC = """geomopt 1
name "gpt-clip"
rule qk match "**.attn.c_attn.weight":
    geometry spectral(indicator, approx=newton_schulz(), view=auto)
    {clip}
rule rest match "**":
    geometry adam
    lr=0.001
"""


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "c_attn" in n:
                p.mul_(6.0)
    plain = copy.deepcopy(model)
    handle = geomopt.monitor_attention(model)
    g = torch.Generator().manual_seed(10 + rank)
    idx = torch.randint(0, 32, (4, 8), generator=g)
    for m in (model, plain):
        m(idx, idx)[1].backward()
        for p in m.parameters():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
    local = {n: s.clone() for n, s in handle.maxima().items()}
    tau = 0.5  # under every head's logits here
    opt = geomopt.GeomOptimizer(model, SPEC.format(clip=f"qk_clip=max_logit(tau={tau})"))
    ref = geomopt.GeomOptimizer(plain, SPEC.format(clip=""))
    opt.step()
    ref.step()
    torch.save({"local": local, "tau": tau, "clipped": {n: p.detach() for n, p in model.named_parameters()},
                "plain": {n: p.detach() for n, p in plain.named_parameters()}}, f"{out}/rank{rank}.pt")
    handle.remove()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
