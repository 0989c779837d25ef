# Unconstrained Scion (Pethick et al. 2025, Recommendation 3.1): p ← p − lr·ρ·lmo(d) with
# momentum d ← 0.1·g + 0.9·d. Hidden matrices: spectral lmo scaled √(dout/din) (ρ_l = 1);
# the output layer: sign lmo scaled 1/din (ρ_L = 10); embeddings: ColNorm of the transposed table
# (Scion's ColNorm(transpose=True)); norms and biases: BiasRMS. ColNorm/BiasRMS are isotropic log
# barriers (ε = 1e-8), the lmos the indicator reference.
# Rules route by role (inferred from the model's structure); view=auto takes each expert of a
# batched MoE weight and each block of a fused projection as its own matrix.
geomopt 1
name "uscion"
defaults lr=0.02 direction=polyak(alpha=0.1)

rule embeddings match role=embedding ndim=2:
    geometry columnwise(log_barrier(eps=1e-8), scale=scion, layout=in_out)

rule head match role=[head, router]:
    geometry anisotropic(indicator, radius=10.0, scale=scion)

rule hidden match role=[hidden, expert]:
    geometry spectral(indicator, approx=newton_schulz, scale=scion, view=auto)

rule rest match "**":  # norms, biases, other vectors: BiasRMS
    geometry isotropic(log_barrier(eps=1e-8), scale=scion)
