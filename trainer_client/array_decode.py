"""Decode every array chunk of an Orbax step with tensorstore — the last part of deep validation.

A checksum proves the bytes are the ones written; decoding proves the written bytes are arrays Orbax
can read back (every chunk decompresses, every shape and dtype matches its metadata). Reads go through
the same OCDBT/zarr layout Orbax uses, without jax, one array at a time.
"""

from __future__ import annotations

import os
from typing import Any

import tensorstore as ts

from trainer_client.array_index import (
    DEFAULT_ITEM,
    ArrayIndexError,
    _item_kvstore_spec,
    read_array_index,
)


def _array_spec(item_kvstore: dict[str, Any], name: str, use_ocdbt: bool, driver: str) -> dict[str, Any]:
    if use_ocdbt:
        kvstore: dict[str, Any] = {"driver": "ocdbt", "base": item_kvstore, "path": name}
    else:
        kvstore = {**item_kvstore, "path": f"{item_kvstore['path']}{name}/"}
    return {"driver": driver, "kvstore": kvstore, "open": True}


def _uses_ocdbt(item_kvstore: dict[str, Any]) -> bool:
    store = ts.KvStore.open(item_kvstore).result()
    return bool(store.read("manifest.ocdbt").result().state == "value")


def decode_all_arrays(step_url: str | os.PathLike[str], item: str = DEFAULT_ITEM) -> list[str]:
    """Read every array of ``<step_url>/<item>`` in full; returns the problems found (empty: all good)."""
    try:
        index = read_array_index(step_url, item)
        item_kvstore = _item_kvstore_spec(step_url, item)
        use_ocdbt = _uses_ocdbt(item_kvstore)
    except (ArrayIndexError, ValueError, OSError, RuntimeError) as exc:
        return [f"arrays: {exc}"]
    problems = []
    for name, info in index.items():
        last_error: Exception | None = None
        for driver in ("zarr", "zarr3"):
            try:
                array = ts.open(_array_spec(item_kvstore, name, use_ocdbt, driver)).result()
                value = array.read().result()
            except (ValueError, OSError, RuntimeError) as exc:
                last_error = exc
                continue
            if tuple(value.shape) != tuple(info.shape):
                problems.append(f"{name}: decoded shape {tuple(value.shape)}, metadata says {info.shape}")
            last_error = None
            break
        if last_error is not None:
            problems.append(f"{name}: cannot decode: {str(last_error).splitlines()[0][:200]}")
    return problems


__all__ = ["decode_all_arrays"]
