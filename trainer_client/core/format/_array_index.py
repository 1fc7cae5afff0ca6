"""Global shape and dtype of every array in an Orbax step, read without jax.

Why this exists: the resume planner needs, per array, the global shape and dtype (to choose target
partition specs and to estimate device memory on the new mesh). Steps written through trainer_client
carry that in ckptd's own custom metadata, but steps written by plain Orbax (docs/architecture.md,
invariant 1: ckptd adopts them) do not, and ``<item>/_METADATA`` records only each leaf's *write* (per-shard) shape. The
global shape and dtype live in each array's zarr metadata, which is where this module reads them. It
must not import jax: the sidecar (which never imports jax) plans resumes too.

Layouts read (all of what Orbax 0.12.8 writes):

- OCDBT (Orbax's default): ``<step>/<item>/manifest.ocdbt`` is a tensorstore OCDBT key-value store
  whose keys are ``<param name>/.zarray`` (zarr v2, Orbax's default) or ``<param name>/zarr.json``
  (zarr v3, ``PyTreeCheckpointHandler(use_zarr3=True)``), next to the chunks.
- Without OCDBT (``use_ocdbt=False``): the same keys as plain files/objects under ``<step>/<item>/``.

Both on a local disk (read without tensorstore: ``trainer_client/core/format/_item_keys.py``) and on
``gs://`` (tensorstore's ``gcs`` driver; it honours ``TENSORSTORE_GCS_HTTP_URL`` itself, which is how an
emulator is used).

The key of each entry is Orbax's *param name*: the leaf's key path with each key as a string (dict
key, sequence index, attribute name of a dataclass/namedtuple) joined by ``"."`` (``"params.w"``,
``"opt.0.mu.b"``). It is the same name that ``<item>/_sharding`` uses (base64-encoded there) and the
same as the keys of ``_METADATA``'s ``tree_metadata`` once their tuple is joined by ``"."``. Like
Orbax's own naming it is ambiguous when a dict key itself contains ``"."`` (``{"a.b": x}`` and
``{"a": {"b": x}}`` both give ``"a.b"``); a key containing ``"/"`` stays in the name as ``"/"``.

Every leaf Orbax stored as an array is listed: ``jax.Array`` (also scalars, shape ``()``), ``np.ndarray``
and Python ``int``/``float`` leaves (Orbax stores those as 0-d arrays too; they have no ``_sharding``
entry). ``None``, empty containers and strings (``_strings.json``) have no array and are not listed.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from trainer_client.core._dtypes import dtype_itemsize, normalize_dtype
from trainer_client.core._errors import ArrayIndexError
from trainer_client.core._storage import Storage
from trainer_client.core.format._files import DEFAULT_ITEM, ITEM_METADATA
from trainer_client.core.format._item_keys import (
    ZARR2_SUFFIX,
    ZARR3_SUFFIX,
    describe,
    fetch,
    item_kvstore_spec,
    tensorstore,
)
from trainer_client.core.format._steps import array_items

DEFAULT_TIMEOUT_S = 60.0

# _METADATA value types that Orbax stores as a zarr array (in 0.12.8).
_ARRAY_VALUE_TYPES = frozenset({"jax.Array", "np.ndarray", "scalar"})

_DECODE_SLAB_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class ArrayInfo:
    """Global shape and element type of one stored array; ``dtype`` is a numpy-style name."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def size(self) -> int:
        """Number of elements (1 for a scalar)."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole array in memory (sub-byte types counted as one byte per element)."""
        return self.size * dtype_itemsize(self.dtype)


def _parse_shape(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in value):
        raise ValueError(f"shape is not a list of integers: {value!r}")
    if any(d < 0 for d in value):
        raise ValueError(f"negative dimension in shape {value!r}")
    return tuple(value)


def _parse_zarr_metadata(key: str, raw: bytes) -> ArrayInfo | None:
    """ArrayInfo from a ``.zarray`` (v2) or ``zarr.json`` (v3) document; None for a v3 group."""
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"not JSON ({exc})") from exc
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    if key.endswith(ZARR3_SUFFIX):
        if doc.get("node_type", "array") != "array":
            return None
        data_type = doc.get("data_type")
        if isinstance(data_type, dict):  # extension data types: {"name": ..., "configuration": ...}
            data_type = data_type.get("name")
        dtype_field = data_type
    else:
        dtype_field = doc.get("dtype")
    if "shape" not in doc:
        raise ValueError("no 'shape'")
    if dtype_field is None:
        raise ValueError("no dtype")
    if not isinstance(dtype_field, str):
        raise ValueError(f"unsupported (structured) dtype {dtype_field!r}")
    return ArrayInfo(shape=_parse_shape(doc["shape"]), dtype=normalize_dtype(dtype_field))


def _expected_array_names(raw: bytes | None) -> set[str] | None:
    """Names of the leaves ``_METADATA`` says were stored as arrays; None when it cannot be understood."""
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
        tree = doc["tree_metadata"]
        if not isinstance(tree, dict):
            return None
        names: set[str] = set()
        for entry in tree.values():
            value = entry["value_metadata"]
            if value.get("value_type") not in _ARRAY_VALUE_TYPES or value.get("skip_deserialize", False):
                continue
            keys: Sequence[Any] = entry["key_metadata"]
            names.add(".".join(str(k["key"]) for k in keys))
        return names
    except (ValueError, UnicodeDecodeError, KeyError, TypeError, AttributeError):
        return None


@dataclass(frozen=True)
class _Located:
    """Where an item's arrays are: its kvstore spec, whether through OCDBT, and each array's zarr driver."""

    spec: dict[str, Any]
    use_ocdbt: bool
    index: dict[str, ArrayInfo]
    drivers: dict[str, str]  # name -> "zarr" (v2) or "zarr3"


def _locate(step_url: str | os.PathLike[str], item: str, timeout: float | None) -> _Located:
    spec = item_kvstore_spec(step_url, item)
    where = describe(spec)
    try:
        use_ocdbt, documents, item_metadata = fetch(spec, timeout)
    except ArrayIndexError:
        raise
    except TimeoutError as exc:
        raise ArrayIndexError(f"reading array metadata of {where} timed out after {timeout} s") from exc
    except (ValueError, OSError, RuntimeError) as exc:
        raise ArrayIndexError(f"cannot read {where}: {exc}") from exc
    layout = "OCDBT store" if use_ocdbt else "directory"
    index: dict[str, ArrayInfo] = {}
    drivers: dict[str, str] = {}
    for key, raw in documents:
        zarr3 = key.endswith(ZARR3_SUFFIX)
        name = key[: -len(ZARR3_SUFFIX if zarr3 else ZARR2_SUFFIX)]
        try:
            info = _parse_zarr_metadata(key, raw)
        except ValueError as exc:
            raise ArrayIndexError(f"corrupt array metadata {key} in {layout} {where}: {exc}") from exc
        if info is None:
            continue
        if name in index:
            raise ArrayIndexError(f"array {name!r} has both zarr v2 and v3 metadata in {where}")
        index[name] = info
        drivers[name] = "zarr3" if zarr3 else "zarr"
    expected = _expected_array_names(item_metadata)
    if expected is not None:
        missing = sorted(expected - index.keys())
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise ArrayIndexError(
                f"{len(missing)} array(s) listed in {where}{ITEM_METADATA} have no zarr metadata in the "
                f"{layout}: {shown}"
            )
    return _Located(spec, use_ocdbt, dict(sorted(index.items())), drivers)


def read_array_index(
    step_url: str | os.PathLike[str],
    item: str = DEFAULT_ITEM,
    *,
    timeout: float | None = DEFAULT_TIMEOUT_S,
) -> dict[str, ArrayInfo]:
    """Global shape and dtype of every array stored in ``<step_url>/<item>``, keyed by Orbax param name.

    ``step_url`` is a step directory: an absolute local path (``file://`` accepted) or
    ``gs://bucket/prefix/<step>``. The result is sorted by name. Raises ArrayIndexError when the item
    does not exist, cannot be read (within ``timeout`` seconds in all; None waits as long as tensorstore
    retries), is an unfinished OCDBT save, holds unparseable zarr metadata, or lacks an array that its
    ``_METADATA`` lists.
    """
    return _locate(step_url, item, timeout).index


def _slabs(shape: tuple[int, ...], row_bytes: int, chunk_rows: int) -> list[tuple[int, int]]:
    """Ranges along the first axis, whole chunks each, of about ``_DECODE_SLAB_BYTES`` at most."""
    if not shape:
        return [(0, 0)]
    rows = max(1, _DECODE_SLAB_BYTES // max(1, row_bytes))
    rows = max(chunk_rows, rows - rows % chunk_rows) if chunk_rows > 0 else rows
    return [(start, min(start + rows, shape[0])) for start in range(0, shape[0], rows)]


def decode_all_arrays(
    step_url: str | os.PathLike[str],
    item: str | None = None,
    *,
    timeout: float | None = DEFAULT_TIMEOUT_S,
) -> list[str]:
    """Read and decode every chunk of every array in ``<step_url>/<item>`` with tensorstore (deep check);
    with no ``item``, in every item of the step that holds arrays (``steps.array_items``: ``default``,
    MaxText's ``items``, ...).

    Returns one problem line per array that cannot be opened or decoded, or whose opened shape/dtype
    disagrees with its metadata; an empty list means every array decoded. Arrays are read in slabs of
    whole chunks of about 256 MiB, so memory stays bounded whatever the array size. ``timeout`` bounds
    the metadata reads only. Raises ArrayIndexError when the index itself cannot be read
    (``read_array_index``). Note that a chunk missing from storage decodes as the fill value: missing
    files are for a manifest comparison to catch, not for this.
    """
    if item is None:
        storage = Storage(os.fspath(step_url))
        return [problem for each in array_items(storage, storage.root)
                for problem in decode_all_arrays(step_url, each, timeout=timeout)]
    ts = tensorstore()  # a deep check decodes every chunk: only the CLI's deep validation comes here

    located = _locate(step_url, item, timeout)
    where = describe(located.spec)
    context = ts.Context()
    problems: list[str] = []
    for name, info in located.index.items():
        if located.use_ocdbt:
            kvstore: dict[str, Any] = {"driver": "ocdbt", "base": located.spec, "path": f"{name}/"}
        else:
            kvstore = {**located.spec, "path": f"{located.spec['path']}{name}/"}
        try:
            array = ts.open(
                {"driver": located.drivers[name], "kvstore": kvstore}, open=True, read=True, context=context
            ).result()
            if tuple(array.shape) != info.shape or normalize_dtype(array.dtype.name) != info.dtype:
                problems.append(
                    f"{name}: opens as {array.dtype.name}{list(array.shape)}, metadata says "
                    f"{info.dtype}{list(info.shape)}"
                )
                continue
            chunk_shape = array.chunk_layout.read_chunk.shape or ()
            chunk_rows = int(chunk_shape[0] or 0) if chunk_shape else 0
            row_bytes = math.prod(info.shape[1:]) * dtype_itemsize(info.dtype)
            for start, stop in _slabs(info.shape, row_bytes, chunk_rows):
                view = array[start:stop] if info.shape else array
                view.read().result()
        except (ValueError, OSError, RuntimeError) as exc:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            problems.append(f"{name}: cannot decode ({first[:300]})")
    if problems:
        problems = [f"{where}{p}" for p in problems]
    return problems


__all__ = [
    "DEFAULT_TIMEOUT_S",
    "ArrayIndexError",
    "ArrayInfo",
    "decode_all_arrays",
    "read_array_index",
]
