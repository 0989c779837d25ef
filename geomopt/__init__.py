"""geomopt: say, per parameter, which geometry it is optimized in and which set it stays in."""
