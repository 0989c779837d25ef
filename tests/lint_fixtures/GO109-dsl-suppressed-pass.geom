# absent: GO109, GO123
# target: none
geomopt 1
name "t"

rule all match "**":
    geometry adam  # geomopt: disable=GO109
