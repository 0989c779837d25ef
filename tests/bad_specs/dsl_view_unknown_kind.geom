geomopt 1
name "demo"
rule hidden match role=hidden:
    geometry spectral(indicator, view=atuo)
