"""Reading a safetensors file's header without loading its tensors (and without pickle, ever).

Format: 8 bytes little-endian header length N, N bytes of JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, then the
tensor bytes; offsets are relative to the end of the header.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from .errors import AdapterInvalid

DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
               "F8_E4M3": 1, "F8_E5M2": 1}
MAX_HEADER_BYTES = 64 * 2**20


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def read_header(path: Path, label: str = "") -> dict[str, TensorInfo]:
    """Parse and check the header: offsets inside the file, sizes consistent, file not truncated."""
    label = label or path.name
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise AdapterInvalid(f"{label}: not a safetensors file (shorter than 8 bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or n + 8 > size:
                raise AdapterInvalid(
                    f"{label}: not a safetensors file (header length {n} does not fit the file of {size} bytes); "
                    "save the adapter with safetensors (PEFT: save_pretrained(safe_serialization=True))"
                )
            raw = f.read(n)
    except OSError as e:
        raise AdapterInvalid(f"{label}: cannot read: {e}") from e
    try:
        header = json.loads(raw)
    except ValueError as e:
        raise AdapterInvalid(f"{label}: safetensors header is not valid JSON: {e}") from e
    if not isinstance(header, dict):
        raise AdapterInvalid(f"{label}: safetensors header is not a JSON object")
    data_len = size - 8 - n
    out: dict[str, TensorInfo] = {}
    end_max = 0
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = str(meta["dtype"])
            shape = tuple(int(x) for x in meta["shape"])
            begin, end = (int(x) for x in meta["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise AdapterInvalid(f"{label}: malformed header entry for tensor {name!r}") from e
        if dtype not in DTYPE_BYTES:
            raise AdapterInvalid(f"{label}: tensor {name!r} has unsupported dtype {dtype}")
        numel = 1
        for d in shape:
            if d < 0:
                raise AdapterInvalid(f"{label}: tensor {name!r} has a negative dimension")
            numel *= d
        if not (0 <= begin <= end <= data_len) or end - begin != numel * DTYPE_BYTES[dtype]:
            raise AdapterInvalid(
                f"{label}: tensor {name!r} data [{begin}, {end}) is inconsistent with its shape {list(shape)} "
                f"or lies beyond the {data_len} data bytes (truncated file?)"
            )
        end_max = max(end_max, end)
        out[name] = TensorInfo(name, dtype, shape, begin, end)
    if end_max != data_len:
        raise AdapterInvalid(f"{label}: {data_len - end_max} trailing bytes after the last tensor")
    return out
