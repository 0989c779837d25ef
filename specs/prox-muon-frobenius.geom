# The paper's NanoGPT setting: uScion's forward steps, plus a proximal Frobenius-ball step on the
# hidden matrices at half their lmo radius (radius 0.5, relative to ρ = √(dout/din)). The forward
# map is Polar Express (5 steps), which realizes the spectral power barrier κ = 4, ε ≈ 1.05e-3
# (paper Theorem 4.7): declaring that reference makes the Frobenius step (which depends on h)
# agree with the forward map. Use approx svd for the exactly-covered variant.
# Rules route by role (inferred from the model's structure); view=auto takes each expert of a
# batched MoE weight and each block of a fused projection as its own matrix.
geomopt 1
name "prox-muon-frobenius"
defaults lr=0.02 direction=polyak(alpha=0.1)

rule embeddings match role=embedding ndim=2:
    geometry columnwise(log_barrier(eps=1e-8), scale=scion, layout=in_out)

rule head match role=[head, router]:
    geometry anisotropic(indicator, radius=10.0, scale=scion)

rule hidden match role=[hidden, expert]:
    geometry spectral(power_barrier(kappa=4.0, eps=0.00105), approx=polar_express, scale=scion, view=auto)
    constraint frobenius_ball(radius=0.5, relative=true)

rule rest match "**":  # norms, biases, other vectors: BiasRMS
    geometry isotropic(log_barrier(eps=1e-8), scale=scion)
