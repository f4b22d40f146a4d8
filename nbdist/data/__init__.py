"""Where samples come from and which rank sees which: arrays, sharding per epoch."""

from nbdist.data.arrays import ArrayData
from nbdist.data.sharding import ShardPlan

__all__ = ["ArrayData", "ShardPlan"]
