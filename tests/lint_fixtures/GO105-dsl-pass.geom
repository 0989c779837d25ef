# absent: GO105
# target: none
geomopt 1
name "t"

rule all match "**":
    geometry adam
