"""What model loading raises: one module below `models` and `gguf_parts`, which both
raise them (so neither imports the other to do it)."""

from __future__ import annotations

__all__ = ["GGUFMissing", "ModelLoadError"]


class ModelLoadError(ValueError):
    """A model could not be loaded or is not usable here; the message is one line."""


class GGUFMissing(ModelLoadError):
    """A bundled model's GGUF (or one of its parts) is not installed."""
