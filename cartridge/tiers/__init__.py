"""Tiers: one codec per tier (encode, reference decode, bytes/token, kernel layout), the registry that
names them (`registry`) and per-(layer, side) schemas (`schema`). Imports flow one way:
codecs -> registry -> schema -> this package."""

from .base import DTYPES, Component, TierCodec
from .registry import DEFAULT_TIER, TIERS, get_tier
from .schema import check_schema, check_tier_options, read_schema, schema_for

__all__ = ["TIERS", "DEFAULT_TIER", "DTYPES", "Component", "TierCodec", "get_tier", "schema_for", "read_schema",
           "check_schema", "check_tier_options"]
