geomopt 1
name "demo"
rule hidden match "**.weight" ndim=2:
    geometry spectral(indicator,
        approx=polar_express(coefficients=[[8.2, -22.5, 15.9], [4.0, -2.8]]))
