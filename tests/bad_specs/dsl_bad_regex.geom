geomopt 1
name "demo"
rule hidden match "re:a((":
    geometry euclidean
