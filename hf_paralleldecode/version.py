"""The library's version (``pyproject.toml`` holds the same string; a test keeps them equal)."""

__version__ = "0.1.0"
