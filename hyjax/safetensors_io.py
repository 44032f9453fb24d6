"""Memory-mapped reading (and writing) of safetensors files, without torch.

A safetensors file is ``u64 header_len | JSON header | raw little-endian tensor bytes``. Tensors
are returned as read-only numpy views into the mapping, so nothing is read from disk until a
tensor is used, and the host never holds the whole model at once.
"""

from __future__ import annotations

import json
import mmap
import os
import struct

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


class SafetensorsFile:
    """One ``.safetensors`` file: ``keys()``, ``shape(name)``, ``get(name) -> np.ndarray``."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        with open(self.path, "rb") as f:
            self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if len(self._mmap) < 8:
            raise ValueError(f"{self.path}: too short to be a safetensors file")
        (n,) = struct.unpack("<Q", self._mmap[:8])
        if n > len(self._mmap) - 8:
            raise ValueError(f"{self.path}: corrupt safetensors header (length {n})")
        header = json.loads(self._mmap[8 : 8 + n])
        header.pop("__metadata__", None)
        self._header = header
        self._data_start = 8 + n

    def keys(self) -> list[str]:
        return list(self._header)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._header[name]["shape"])

    def dtype(self, name: str) -> np.dtype:
        code = self._header[name]["dtype"]
        if code not in _DTYPES:
            raise ValueError(f"{self.path}: tensor {name!r} has unsupported dtype {code}")
        return np.dtype(_DTYPES[code])

    def get(self, name: str) -> np.ndarray:
        info = self._header[name]
        begin, end = info["data_offsets"]
        dtype = self.dtype(name)
        arr = np.frombuffer(
            self._mmap,
            dtype=dtype,
            count=(end - begin) // dtype.itemsize,
            offset=self._data_start + begin,
        )
        return arr.reshape(info["shape"])


def save_file(tensors: dict[str, np.ndarray], path: str | os.PathLike, metadata=None) -> None:
    """Writes numpy arrays (including ml_dtypes bfloat16) as a safetensors file."""
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    arrays = []
    for name in sorted(tensors):
        arr = np.ascontiguousarray(tensors[name])
        nbytes = arr.nbytes
        header[name] = {
            "dtype": _NAMES[arr.dtype],
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
        arrays.append(arr)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for arr in arrays:
            f.write(arr.tobytes())
