# expect: GO123 7:25
# target: none
geomopt 1
name "t"

rule all match "**":
    geometry euclidean  # geomopt: disable=outside-theory
