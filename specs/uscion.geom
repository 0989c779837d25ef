geomopt 1
name "uscion"
defaults lr=0.02 direction=polyak

rule embeddings match module=Embedding:
    geometry columnwise(log_barrier, scale=scion, layout=in_out)

rule head match "re:(lm_)?head\\.weight":
    geometry anisotropic(indicator, radius=10.0, scale=scion)

rule hidden match "**.weight" ndim=[2, 3, 4, 5]:
    geometry spectral(indicator, approx=newton_schulz, scale=scion)

rule rest match "**":
    geometry isotropic(log_barrier, scale=scion)
