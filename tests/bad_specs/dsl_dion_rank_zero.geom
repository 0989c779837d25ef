geomopt 1
name "demo"
rule hidden match "**.weight" ndim=2:
    geometry euclidean
    direction dion(rank=0)
rule rest match "**":
    geometry adam
