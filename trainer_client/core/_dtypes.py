"""Element types: one table of names and sizes for every reader of stored arrays and every estimate.

Orbax stores arrays as zarr, whose dtype strings (``"<f4"``, ``"bfloat16"``) name numpy types and the
ml_dtypes extensions JAX uses (bfloat16, float8_*, int4, ...). The planner's memory estimates, the zarr
index and the host-memory snapshot format all ask here, so a type has one size everywhere.
"""

from __future__ import annotations

import numpy as np

# Element types numpy does not know by name (ml_dtypes'), with the bytes per element used for memory
# estimates: sub-byte types are rounded up to one byte.
_EXTENDED_ITEMSIZE: dict[str, int] = {
    "bfloat16": 2,
    "float8_e3m4": 1,
    "float8_e4m3": 1,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e4m3b11fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "float6_e2m3fn": 1,
    "float6_e3m2fn": 1,
    "float4_e2m1fn": 1,
    "int4": 1,
    "uint4": 1,
    "int2": 1,
    "uint2": 1,
}
_NUMERIC_KINDS = frozenset("biufc")  # bool, signed, unsigned, float, complex


def _known_name(name: str) -> bool:
    return name in _EXTENDED_ITEMSIZE or name.startswith("float8_")


def normalize_dtype(dtype: str) -> str:
    """A numpy-style name (``"float32"``, ``"bfloat16"``) for a zarr v2 (``"<f4"``) or v3 dtype string.

    Raises ValueError for anything that is not a numeric element type.
    """
    if not isinstance(dtype, str) or not dtype:
        raise ValueError(f"not a dtype string: {dtype!r}")
    if _known_name(dtype):
        return dtype
    try:
        parsed = np.dtype(dtype)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"unknown dtype {dtype!r}") from exc
    if parsed.kind not in _NUMERIC_KINDS or parsed.fields is not None or parsed.subdtype is not None:
        raise ValueError(f"unsupported (non-numeric) dtype {dtype!r}")
    return parsed.name


def dtype_itemsize(dtype: str) -> int:
    """Bytes per element for memory estimates: bfloat16 2, float8_* / int4 / uint4 1, else numpy's itemsize.

    Accepts numpy-style names and the zarr strings ``normalize_dtype`` accepts; ValueError otherwise.
    """
    name = normalize_dtype(dtype)
    if name in _EXTENDED_ITEMSIZE:
        return _EXTENDED_ITEMSIZE[name]
    if name.startswith("float8_"):
        return 1
    return int(np.dtype(name).itemsize)


def dtype_bytes(dtype: str | None) -> int:
    """Bytes per element for memory estimates; a dtype that is not recorded or not known counts as 4."""
    if not dtype:
        return 4
    try:
        return dtype_itemsize(dtype)
    except ValueError:
        return 4


def np_dtype(name: str) -> np.dtype[np.generic]:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


__all__ = ["dtype_bytes", "dtype_itemsize", "normalize_dtype", "np_dtype"]
