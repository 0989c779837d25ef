geomopt 1
name "demo"
rule hidden match "**.weight" ndim=2:
    geometry spectral(indicator)
    lr=0.02
    lr 0.01
