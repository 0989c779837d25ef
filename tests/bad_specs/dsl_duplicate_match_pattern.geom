geomopt 1
name "demo"
rule hidden match "**.weight" name="*.bias":
    geometry spectral(indicator)
