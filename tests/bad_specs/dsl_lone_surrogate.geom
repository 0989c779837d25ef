geomopt 1
name "demo \udc80"
rule hidden match "**.weight" ndim=2:
    geometry spectral(indicator)
