geomopt 1
rule hidden match "**.weight" ndim=2:
    geometry spectral(indicator)
