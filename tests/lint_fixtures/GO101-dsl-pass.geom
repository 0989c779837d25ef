# absent: GO101
# target: mlp
geomopt 1
name "t"

rule hidden match "**":
    geometry euclidean
