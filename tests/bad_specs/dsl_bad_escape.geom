geomopt 1
name "demo"
rule hidden match "re:\d+\.weight":
    geometry euclidean
