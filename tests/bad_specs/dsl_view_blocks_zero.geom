geomopt 1
name "demo"
rule hidden match role=hidden:
    geometry spectral(indicator, view=matrix(batch=1, blocks=0))
