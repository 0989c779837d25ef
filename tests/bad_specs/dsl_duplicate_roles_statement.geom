geomopt 1
name "demo"
roles head=["fc.weight"]
roles router=["**.gate.weight"]
rule rest match "**":
    geometry euclidean
