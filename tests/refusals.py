"""The shipped specs that refuse sharded (DTensor) parameters, and what their refusal says: the
layout tests take the refusal as the result for these (every other spec must run and match one
process). Dion's power iteration and QR need each matrix whole; QK-clip rescales whole query/key
projections (muonclip)."""

REFUSED_ON_SHARDS = {
    "dion": "needs whole matrices",
    "muonclip": "qk_clip: sharded (DTensor) parameters are not supported",
}
