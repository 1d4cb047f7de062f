"""Presets: a named outcome resolved to concrete build options (docs/tiers.md "Presets").

Each preset is a K tier, a V tier and a token protection, applied to every layer; `resolve` turns it
into `cartridge.build` keywords, and the built cartridge's header holds the resulting per-layer schema
(shown by `cartridge inspect`), so a cartridge never depends on what a preset name meant when it was built.
Measured fidelity and size of each on the sample: docs/evaluation.md "Rotation, protection, presets".
"""

from ..errors import InputError

PRESETS = {
    # fp16: answers identical to a fresh prefill
    "exact": {"k_tier": "fp16", "v_tier": "fp16", "protect_first": 0, "protect_last": 0},
    # 8-bit rotated K (the side whose error moves the softmax), 6-bit rotated V: 2.0x (8 bits an element)
    "safe": {"k_tier": "int8+rot", "v_tier": "int6+rot", "protect_first": 0, "protect_last": 0},
    # 4-bit rotated K and V with the sink and question-side tokens in fp16; 3.01x on the 1,631-token
    # sample (the fp16 copies weigh less on longer documents: 3.2x in the limit)
    "balanced": {"k_tier": "mlx4g32+rot", "v_tier": "mlx4g32+rot", "protect_first": 4, "protect_last": 28},
    # 4-bit rotated K, 2-bit V (V's error averages out in p.V); 4.64x on the sample, 4.9x in the limit
    "compact": {"k_tier": "mxfp4+rot", "v_tier": "turbo2", "protect_first": 4, "protect_last": 16},
}


def resolve(name):
    """The build keywords of preset `name` (a new dict).

    Raises:
        InputError: an unknown preset name.

    Example:
        >>> resolve("balanced")["k_tier"]
        'mlx4g32+rot'
    """
    if name not in PRESETS:
        raise InputError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
    return dict(PRESETS[name])


def apply(preset, tier, k_tier, v_tier, boundary_protect, schema, protect_first, protect_last):
    """Build options with `preset` filled in; a preset excludes every tier and protection option.

    Returns:
        dict: tier, k_tier, v_tier, boundary_protect, schema, protect_first, protect_last.

    Raises:
        InputError: unknown preset, or a preset combined with an option it sets.
    """
    given = {"tier": tier != "fp16", "k_tier": k_tier is not None, "v_tier": v_tier is not None,
             "boundary_protect": bool(boundary_protect), "schema": schema is not None,
             "protect_first": bool(protect_first), "protect_last": bool(protect_last)}
    if preset is None:
        return {"tier": tier, "k_tier": k_tier, "v_tier": v_tier, "boundary_protect": boundary_protect,
                "schema": schema, "protect_first": protect_first, "protect_last": protect_last}
    clash = [k for k, v in given.items() if v]
    if clash:
        raise InputError(f"preset {preset!r} sets the tiers and protection; it cannot be combined with {', '.join(clash)}")
    return {"tier": "fp16", "boundary_protect": 0, "schema": None, **resolve(preset)}
