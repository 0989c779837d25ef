geomopt: 1
name: demo
rules:
  - name: hidden
    match: {name: "**.weight", ndim: 2}
    geometry:
      kind: spectral
      reference: {kind: indicator}
