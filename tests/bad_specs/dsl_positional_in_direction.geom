geomopt 1
name "demo"
rule hidden match "**.weight" ndim=2:
    geometry spectral(indicator)
    direction=polyak(0.1)
