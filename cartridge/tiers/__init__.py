"""Tier registry: tier name -> codec instance. Unknown names are refused (never looked up by reflection)."""

from ..errors import InputError
from .base import DTYPES, Component, TierCodec
from .float16 import BFloat16Codec, Float16Codec

TIERS = {codec.name: codec for codec in (Float16Codec(), BFloat16Codec())}
DEFAULT_TIER = "fp16"


def get_tier(name):
    """Return the codec registered as `name`.

    Raises:
        InputError: if `name` is not a known tier.
    """
    codec = TIERS.get(name)
    if codec is None:
        raise InputError(f"unknown tier {name!r}; known tiers: {', '.join(TIERS)}")
    return codec


__all__ = ["TIERS", "DEFAULT_TIER", "DTYPES", "Component", "TierCodec", "get_tier"]
