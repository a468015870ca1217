"""The one table of tensor element types that cross the wire: name -> bytes per element (torch names)."""

from __future__ import annotations

ITEMSIZE: dict[str, int] = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float64": 8,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}
#: what tensor frames (compressed updates, activations) may carry; states also carry the integer types
FLOAT_DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16", "float64")
