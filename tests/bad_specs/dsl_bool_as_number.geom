geomopt 1
name "demo"
defaults direction=polyak(alpha=0.1, nesterov=1)
rule hidden match "**.weight" ndim=2:
    geometry spectral(indicator)
