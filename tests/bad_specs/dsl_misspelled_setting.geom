geomopt 1
name "demo"
defaults lrr=0.02
rule hidden match "**.weight" ndim=2:
    geometry spectral(indicator)
