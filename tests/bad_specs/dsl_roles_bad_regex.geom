geomopt 1
name "demo"
roles head=["fc.weight", "re:proj(("]
rule rest match "**":
    geometry euclidean
