geomopt 1
name "demo"
defaults lr=0.02
