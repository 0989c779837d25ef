geomopt 1
name "demo"
rule hidden match nmae="**.weight":
    geometry spectral(indicator)
