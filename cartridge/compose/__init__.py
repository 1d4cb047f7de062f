"""Several cartridges in one context, one after another (`composed`), with CacheBlend's recompute (`blend`)."""

from .composed import ComposedCartridge, boundary_tokens, compose, separator_tokens

__all__ = ["ComposedCartridge", "boundary_tokens", "compose", "separator_tokens"]
