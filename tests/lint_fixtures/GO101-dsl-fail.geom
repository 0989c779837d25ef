# expect: GO101 6:1
# target: mlp
geomopt 1
name "t"

rule hidden match "layers.*.weight":
    geometry euclidean
