geomopt 1
name "demo"
rule hidden match "":
    geometry euclidean
