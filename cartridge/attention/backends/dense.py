"""The dense backend: the prefix decoded once at load to pages of the model's dtype ("dequantize-once")."""

from .base import AttentionBackend


class Dense(AttentionBackend):
    """Reads every tier (it decodes them: `cartridge.attention.policy.dequantize`); its dense pages are then read
    by the portable path, or by the device's fused kernel where one reads dense pages (`layout.DENSE_LAYOUTS`)."""

    name = "dense"
    policy = "dequantize-once"


DENSE = Dense()
