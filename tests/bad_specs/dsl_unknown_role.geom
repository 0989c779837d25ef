geomopt 1
name "demo"
rule hidden match role=[hidden, exprt] ndim=2:
    geometry spectral(indicator, view=auto)
