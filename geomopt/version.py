"""The package's version (one place: the package, the lock files it writes and the CLI read it)."""

__version__ = "0.1.0"
