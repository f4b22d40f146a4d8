"""A checkpoint share's safetensors file, written straight from the arrays' memory.

`safetensors.numpy.save` builds the whole file as one bytes object before it is written:
for a model of millions of parameters that is a second copy of every array in freshly
allocated memory (each page faulted in), on the checkpoint writer's thread, while the
rank's training goes on beside it on the same cores. Here the same header is written,
and the arrays' own buffers follow it into the file, hashed on the way: the same bytes
(read back with safetensors' load_file and safe_open), one pass over the data, no copy.
A dtype that safetensors' numpy mapping does not know goes through its `save` as before.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save

from nbdist.durable import DIGEST, naming, open_private, write_bytes

__all__ = ["write_safetensors"]

# numpy dtype -> safetensors dtype (little-endian, as the format stores them), in the
# order of safetensors' own dtype list: its `save` lays the arrays out by that order,
# last first, then by name, and so does this module, so that the files are byte for byte
# the ones `save` makes.
_DTYPES = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "int16": "I16",
    "uint16": "U16",
    "float16": "F16",
    "int32": "I32",
    "uint32": "U32",
    "float32": "F32",
    "float64": "F64",
    "int64": "I64",
    "uint64": "U64",
}
_RANK = {name: rank for rank, name in enumerate(_DTYPES)}
HEADER_ALIGN = 8  # the header is padded with spaces to this many bytes, as safetensors pads it


def _writable(array: np.ndarray) -> bool:
    return array.dtype.name in _DTYPES and array.dtype.byteorder in "=<|" and array.flags.c_contiguous


def write_safetensors(path: Path, flat: dict[str, np.ndarray]) -> dict[str, Any]:
    """Write `flat` (name -> C-ordered array) as a safetensors file and fsync it; returns
    its size and digest, as durable.write_bytes does."""
    if not all(_writable(array) for array in flat.values()):
        return write_bytes(path, save(flat))
    flat = dict(sorted(flat.items(), key=lambda item: (-_RANK[item[1].dtype.name], item[0])))
    header: dict[str, Any] = {}
    offset = 0
    for name, array in flat.items():
        header[name] = {
            "dtype": _DTYPES[array.dtype.name],
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        offset += array.nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % HEADER_ALIGN)
    head = len(text).to_bytes(8, "little") + text
    digest = hashlib.new(DIGEST, head)
    with naming(path), open_private(path, "wb") as fh:
        fh.write(head)
        for array in flat.values():
            if array.nbytes:
                data = array.reshape(-1).data.cast("B")
                fh.write(data)
                digest.update(data)
        fh.flush()
        os.fsync(fh.fileno())
    return {"bytes": len(head) + offset, DIGEST: digest.hexdigest()}
