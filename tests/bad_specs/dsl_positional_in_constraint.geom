geomopt 1
name "demo"
rule hidden match "**.weight" ndim=2:
    geometry spectral(indicator)
    constraint frobenius_ball(0.5)
