"""Where samples come from and which rank sees which: arrays, HDF5 file lists, sharding
per epoch."""

from nbdist.data.arrays import ArrayData
from nbdist.data.base import Data, DataError, DataReadError
from nbdist.data.files import HDF5Data
from nbdist.data.sharding import FilePlan, ShardPlan

__all__ = ["Data", "ArrayData", "HDF5Data", "DataError", "DataReadError", "ShardPlan", "FilePlan"]
