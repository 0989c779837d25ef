geomopt 1
name "demo"
rule hidden:
    geometry spectral(indicator)
