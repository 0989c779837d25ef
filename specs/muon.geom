geomopt 1
name "muon"
defaults lr=0.02 weight_decay=0.1

rule embeddings match module=Embedding:
    geometry adam(betas=[0.9, 0.95])
    lr=0.001

rule head match "re:(lm_)?head\\.weight":
    geometry adam(betas=[0.9, 0.95])
    lr=0.001

rule hidden match "**.weight" ndim=2:
    geometry spectral(indicator, approx=newton_schulz, prenormalize=max, scale=muon_original)
    direction=polyak(alpha=0.05, nesterov=true)

rule rest match "**":
    geometry adam(betas=[0.9, 0.95])
    lr=0.001
    weight_decay=0.0
