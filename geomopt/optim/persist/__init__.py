"""Persistence: checkpoints (save, validate, load, migrate) and the state precision codec."""
