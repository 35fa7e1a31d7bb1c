"""The package version, in a module of its own so that any layer may read it without importing
``pagedllm/__init__.py`` (which reaches the entry points)."""

__version__ = "0.1.0"
