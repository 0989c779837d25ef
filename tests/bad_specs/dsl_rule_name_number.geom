geomopt 1
name "demo"
rule 2nd match "**":
    geometry spectral(indicator)
