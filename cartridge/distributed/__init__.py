"""Cartridges under MLX distributed (`mlx.launch`): every rank maps only its slice, the ranks agree."""

from .agreement import agree
from .build import build_sharded
from .load import MODES, ShardedCartridge, load_sharded, load_sharded_model, recorded_model, shard_model

__all__ = ["MODES", "ShardedCartridge", "agree", "build_sharded", "load_sharded", "load_sharded_model",
           "recorded_model", "shard_model"]
