geomopt 1
name "demo"
rule hidden match "**.weight" ndim=2:
    geometry spectral(indicator, radius=1.0, radius=2.0)
