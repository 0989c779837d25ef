"""The shipped specs that refuse sharded (DTensor) parameters, and what their refusal says: the
layout tests take the refusal as the result for these (every other spec must run and match one
process). Dion's power iteration and QR need each matrix whole; the kronecker geometry's factors
live with the whole matrix (shampoo, scalable-shampoo, soap, soap-muon, psgd-kron); QK-clip
rescales whole query/key projections (muonclip)."""

REFUSED_ON_SHARDS = {
    "dion": "needs whole matrices",
    "psgd-kron": "cannot run on sharded (DTensor) parameters",
    "scalable-shampoo": "cannot run on sharded (DTensor) parameters",
    "shampoo": "cannot run on sharded (DTensor) parameters",
    "soap": "cannot run on sharded (DTensor) parameters",
    "soap-muon": "cannot run on sharded (DTensor) parameters",
    "muonclip": "qk_clip: sharded (DTensor) parameters are not supported",
}
