geomopt 1
name "demo"
name "again"
rule hidden match "**.weight" ndim=2:
    geometry spectral(indicator)
