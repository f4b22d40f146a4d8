"""Where samples come from and which rank sees which: arrays, HDF5 file lists, sharding
per epoch."""

from nbdist.data.arrays import ArrayData
from nbdist.data.base import Data
from nbdist.data.files import DataError, HDF5Data
from nbdist.data.sharding import FilePlan, ShardPlan

__all__ = ["Data", "ArrayData", "HDF5Data", "DataError", "ShardPlan", "FilePlan"]
