geomopt 1
name "demo"
defaults lr=0.02 direction=polyk(alpha=0.1)
rule hidden match "**.weight" ndim=2:
    geometry spectral(indicator)
