# expect: GO105 8:16
# target: none
geomopt 1
name "t"

rule all match "**":
    geometry adam
    constraint l2_ball(radius=1.0)
