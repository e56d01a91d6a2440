"""The package version (read by ``pyproject.toml`` and recorded in manifests and cache keys)."""

__version__ = "0.1.0"
