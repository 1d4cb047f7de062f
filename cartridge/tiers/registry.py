"""Tier registry: tier name -> codec instance. Unknown names are refused (never looked up by reflection)."""

from ..errors import InputError
from .affine import Int6Codec, Int8Codec, Mlx4G32Codec
from .float16 import BFloat16Codec, Float16Codec
from .kivi import Kivi4Codec
from .mxfp import Fp8Codec, Mxfp4Codec, Nvfp4Codec
from .presets import PRESETS
from .rotation import RotatedCodec
from .turbo import Turbo2Codec, Turbo3Codec, Turbo4Codec

TIERS = {
    codec.name: codec
    for codec in (
        Float16Codec(), BFloat16Codec(), Int8Codec(), Int6Codec(), Mlx4G32Codec(), Fp8Codec(), Mxfp4Codec(), Nvfp4Codec(),
        Turbo4Codec(), Turbo3Codec(), Turbo2Codec(), Kivi4Codec(),
        *(RotatedCodec(base()) for base in (Int8Codec, Int6Codec, Mlx4G32Codec, Mxfp4Codec, Nvfp4Codec)),
    )
}
DEFAULT_TIER = "fp16"


def get_tier(name):
    """Return the codec registered as `name`.

    Args:
        name (str): a tier name, e.g. "mlx4g32" or "int8+rot".

    Returns:
        TierCodec: the registered codec instance.

    Raises:
        InputError: if `name` is not a known tier.
    """
    codec = TIERS.get(name)
    if codec is None:
        hint = f" ({name} is a preset: --preset {name}, Python preset=)" if name in PRESETS else ""
        raise InputError(f"unknown tier {name!r}{hint}; known tiers: {', '.join(TIERS)}")
    return codec
