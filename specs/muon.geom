# torch.optim.Muon as a spec: hidden matrices get the spectral lmo through Muon's quintic
# Newton–Schulz (bf16 on CUDA), D/max(‖D‖_F, 1e-7) pre-normalization, momentum 0.95 with Nesterov
# (alpha = 1 − 0.95), the "original" lr adjustment √max(1, dout/din) and decoupled weight decay
# 0.1. Everything that is not a hidden matrix (embeddings, head, norms, biases) uses AdamW.
# The hidden rule comes first: frameworks that log param_groups[0]["lr"] (Hugging Face's Trainer)
# show its lr, not the AdamW rules' (routing is by role, so the order moves no tensor).
# Rules route by role (inferred from the model's structure); view=auto orthogonalizes each expert
# of a batched MoE weight and each block of a fused projection as its own matrix.
geomopt 1
name "muon"
defaults lr=0.02 weight_decay=0.1

rule hidden match role=[hidden, expert]:
    # Newton–Schulz: 5 steps; dtype auto: bf16 on CUDA (as torch.optim.Muon), fp32 on CPU
    geometry spectral(indicator, approx=newton_schulz, prenormalize=max, scale=muon_original, view=auto)
    direction=polyak(alpha=0.05, nesterov=true)

rule embeddings match role=embedding:
    geometry adam(betas=[0.9, 0.95])
    lr=0.001

rule head match role=[head, router]:
    geometry adam(betas=[0.9, 0.95])
    lr=0.001

rule rest match "**":  # norms, biases, other vectors
    geometry adam(betas=[0.9, 0.95])
    lr=0.001
    weight_decay=0.0
