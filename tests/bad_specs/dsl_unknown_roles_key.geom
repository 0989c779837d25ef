geomopt 1
name "demo"
roles head=["fc.weight"] routr=["**.gate.weight"]
rule rest match "**":
    geometry euclidean
