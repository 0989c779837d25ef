geomopt 1
name "demo"
rule hidden match "**.weight:
    geometry euclidean
