"""The engine: param groups, step programs and their execution (flat, batched, capturable), atomic commits."""
