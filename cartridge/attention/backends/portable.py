"""The portable backend: MLX ops over the stored pages (`cartridge.attention.kernels.portable`), everywhere."""

from .base import AttentionBackend


class Portable(AttentionBackend):
    """Reads every tier on every device; the path every other backend falls back to (its `build` is None)."""

    name = "portable"
    policy = "portable"


PORTABLE = Portable()
