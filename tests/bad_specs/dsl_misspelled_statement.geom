geomopt 1
name "demo"
rules hidden match "**":
    geometry spectral(indicator)
