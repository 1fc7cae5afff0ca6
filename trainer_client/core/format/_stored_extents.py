"""Whether what a step declares about its arrays agrees with the bytes it holds: checked before a step written
without a manifest counts (adoption, and the storage-only answer), so a step whose metadata contradicts its
data is never named good (docs/concepts.md, "Good").

A manifest records sizes and checksums of the files present; it says nothing of whether ``params.w``
declared ``[1048576, 1048576]`` in ckptd's training metadata (``_CHECKPOINT_METADATA``, plain JSON) is what
the zarr arrays hold. Two checks, both without decoding a chunk:

* **declared against stored**: every array ckptd's training metadata declares that the step stores has the
  same global shape and dtype in its zarr metadata (``_array_index.read_array_index``: the zarr documents, through the
  OCDBT index on a local disk, tensorstore on ``gs://``);
* **extents** (local roots, OCDBT, zarr v2: what Orbax writes by default): every chunk stored for an array is
  one of its chunk grid (``ceil(shape / chunks)`` along each axis), and no chunk is longer than its raw bytes
  could compress to (exactly its raw bytes when uncompressed, at most zstd's bound otherwise). A chunk
  absent is not a contradiction: zarr reads it as the fill value, and tensorstore does not store chunks
  equal to it.

What the checks cannot see: a forged zarr document together with forged training metadata that agree with
each other and keep every stored chunk inside the grid (an array declared larger than its data, the rest
read as zeros). Deep validation (``ckptd validate --deep``) decodes every chunk.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from trainer_client.core._dtypes import dtype_itemsize, normalize_dtype
from trainer_client.core._errors import ArrayIndexError, OcdbtFormatError
from trainer_client.core._storage import Storage
from trainer_client.core.format._array_index import read_array_index
from trainer_client.core.format._files import OCDBT_MANIFEST
from trainer_client.core.format._item_keys import ZARR2_SUFFIX
from trainer_client.core.format._ocdbt_index import OcdbtIndex
from trainer_client.core.format._steps import read_training

MAX_SHOWN = 5  # contradictions named per step


def _compress_bound(raw: int) -> int:
    """The most bytes a compressor of zarr chunks may write for ``raw`` bytes (zstd's ``ZSTD_COMPRESSBOUND``,
    generously: blosc and lz4 stay under it too)."""
    return raw + (raw >> 7) + 1024


def _declared_problems(storage: Storage, step_path: str) -> list[str]:
    training, item = read_training(storage, step_path)
    if training is None or not training.arrays:
        return []
    try:
        stored = read_array_index(storage.url_of(step_path), item)
    except ArrayIndexError:
        return []  # no zarr metadata to compare with (a step without arrays there): the manifest check decides
    problems = []
    for name, spec in sorted(training.arrays.items()):
        info = stored.get(name)
        if info is None:  # not compared yet: the tests' own steps declare arrays they do not store
            continue
        if spec.shape is not None and tuple(spec.shape) != info.shape:
            problems.append(f"{name}: declared shape {list(spec.shape)}, stored {list(info.shape)}")
        if spec.dtype is not None and normalize_dtype(spec.dtype) != info.dtype:
            problems.append(f"{name}: declared dtype {spec.dtype}, stored {info.dtype}")
    return problems


def _zarr2(raw: bytes) -> tuple[tuple[int, ...], tuple[int, ...], int, bool, str] | None:
    """(shape, chunks, item size, compressed, separator) of a ``.zarray``; None when it says something else."""
    try:
        doc: Any = json.loads(raw)
        shape, chunks = tuple(doc["shape"]), tuple(doc["chunks"])
        size = dtype_itemsize(normalize_dtype(doc["dtype"]))
    except (ValueError, KeyError, TypeError):
        return None
    if len(shape) != len(chunks) or not all(isinstance(d, int) and d >= 0 for d in shape) or \
            not all(isinstance(c, int) and c > 0 for c in chunks):
        return None
    separator = doc.get("dimension_separator") or "."
    return shape, chunks, size, doc.get("compressor") is not None, separator if isinstance(separator, str) else "."


def _extent_problems(item_dir: Path, index: OcdbtIndex) -> list[str]:
    problems: list[str] = []
    arrays = {key[: -len(ZARR2_SUFFIX)]: key for key in index.values if key.endswith(ZARR2_SUFFIX)}
    grids: dict[str, tuple[tuple[int, ...], int, bool, str]] = {}
    for name, key in arrays.items():
        parsed = _zarr2(index.read(key))
        if parsed is None:
            continue
        shape, chunks, size, compressed, separator = parsed
        grid = tuple(-(-d // c) for d, c in zip(shape, chunks, strict=True))  # exact: no float of a 400-digit shape
        grids[name] = (grid, math.prod(chunks) * size, compressed, separator)
    for key, ref in index.values.items():
        name, _, chunk = key.rpartition("/")
        known = grids.get(name)
        if known is None or chunk.startswith("."):
            continue
        grid, raw, compressed, separator = known
        where = f"{item_dir.name}/{key}"
        try:
            at = tuple(int(i) for i in chunk.split(separator)) if grid else (int(chunk),)
        except ValueError:
            problems.append(f"{where}: not a chunk of {name}")
            continue
        if (not grid and at != (0,)) or (grid and (len(at) != len(grid) or
                                                   any(not 0 <= i < n for i, n in zip(at, grid, strict=True)))):
            problems.append(f"{where}: chunk {list(at)} is outside {name}'s chunk grid {list(grid)} (its shape)")
        elif not compressed and ref.length != raw:
            problems.append(f"{where}: {ref.length} bytes, an uncompressed chunk of {name} is {raw}")
        elif ref.length > _compress_bound(raw):
            problems.append(f"{where}: {ref.length} bytes, more than a chunk of {name} ({raw} bytes raw) compresses to")
    return problems


def stored_contradictions(storage: Storage, step_path: str) -> list[str]:
    """What the step at ``step_path`` declares about its arrays that its stored bytes contradict (empty: nothing
    found). Reads metadata and indexes only, never a chunk."""
    problems = _declared_problems(storage, step_path)
    if not storage.is_remote:
        top = Path(step_path)
        for item_dir in sorted(p for p in [top, *top.iterdir()] if p.is_dir() and not p.is_symlink()):
            if not (item_dir / OCDBT_MANIFEST).is_file():
                continue
            try:
                index = OcdbtIndex(item_dir)
            except (OcdbtFormatError, OSError):
                continue  # read by tensorstore or refused: the array index and the restore say what is wrong
            problems += _extent_problems(item_dir, index)
    return problems


def contradiction_summary(problems: list[str]) -> str:
    """One line for a quarantine reason or a refusal."""
    more = f" and {len(problems) - MAX_SHOWN} more" if len(problems) > MAX_SHOWN else ""
    return "its metadata contradicts its data: " + "; ".join(problems[:MAX_SHOWN]) + more


__all__ = ["contradiction_summary", "stored_contradictions"]
