"""Zero-copy reading of safetensors files (numpy views over an mmap), bfloat16 included.

The numpy backend of the `safetensors` package cannot return bfloat16, the dtype most checkpoints
ship in; the format is simple enough (8-byte header length, JSON header, raw data) to read here.
"""
from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path
from typing import Iterator

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_,
}


class SafetensorsError(ValueError):
    """A safetensors file is malformed or uses an unsupported dtype."""


def _header(buf: mmap.mmap, path: Path) -> tuple[dict, int]:
    if len(buf) < 8:
        raise SafetensorsError(f"{path} is too short to be a safetensors file")
    (n,) = struct.unpack("<Q", buf[:8])
    if 8 + n > len(buf):
        raise SafetensorsError(f"{path}: header length {n} runs past the end of the file")
    try:
        header = json.loads(bytes(buf[8:8 + n]))
    except json.JSONDecodeError as e:
        raise SafetensorsError(f"{path}: header is not valid JSON ({e})") from e
    header.pop("__metadata__", None)
    return header, 8 + n


def read_header(path: str | Path) -> dict:
    """{name: {"dtype", "shape", "data_offsets"}} without reading any tensor data."""
    path = Path(path)
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    return _header(buf, path)[0]


def iter_tensors(path: str | Path) -> Iterator[tuple[str, np.ndarray]]:
    """Yields (name, read-only array view) for each tensor in one file, in file order."""
    path = Path(path)
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    header, base = _header(buf, path)
    for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        dtype = DTYPES.get(info["dtype"])
        if dtype is None:
            raise SafetensorsError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        arr = np.frombuffer(buf, dtype=dtype, count=(end - start) // np.dtype(dtype).itemsize,
                            offset=base + start)
        yield name, arr.reshape(info["shape"])


def write_tensors(path: str | Path, tensors: dict[str, np.ndarray],
                  metadata: dict[str, str] | None = None) -> None:
    """Writes arrays (bfloat16 included) as one safetensors file."""
    names = {np.dtype(v): k for k, v in DTYPES.items()}
    header, offset = {}, 0
    for name, arr in tensors.items():
        nbytes = arr.nbytes
        header[name] = {"dtype": names[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        header["__metadata__"] = metadata
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for arr in tensors.values():
            f.write(np.ascontiguousarray(arr).tobytes())
