"""The package version (kept apart so any layer can read it without importing the API)."""

__version__ = "0.1.0"
