geomopt 1
name "demo"
rule hidden match "**.weight" ndim=2:
    geometry spectral(power_barrier(kapa=4), approx=svd)
