"""A step whose metadata contradicts its data is never named good (checked by
``trainer_client/core/format/_stored_extents.py``): a real Orbax step without ckptd's records, its training
metadata re-declaring ``params.w`` as ``[1048576, 1048576]`` over 128 bytes of data, or a chunk of its OCDBT
database longer than the chunk could be, is quarantined at adoption, not adopted, and the storage-only answer
(``latest_good_on_storage``, what the client falls back to) passes over it too. The true step before it is
what both name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import pytest

from ckptd.catalog._catalog import Catalog
from tests.support.orbax_steps import training_metadata, write_orbax_steps
from trainer_client.core._storage import Storage
from trainer_client.core._validation import latest_good_on_storage
from trainer_client.core.format._files import CHECKPOINT_METADATA
from trainer_client.core.format._ocdbt_index import OcdbtIndex, ValueRef
from trainer_client.core.format._stored_extents import _extent_problems, stored_contradictions
from trainer_client.core.protocol import StepState

STORED: dict[str, dict[str, Any]] = {
    "params.w": {"shape": [4, 8], "dtype": "float32", "partition_spec": [None, "data"]},
    "step": {"shape": [], "dtype": "int32", "partition_spec": []},
}


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("contradicting")
    write_orbax_steps(root / "job", [10, 20], custom_metadata={s: training_metadata(s, arrays=STORED)
                                                                   for s in (10, 20)})
    return root


def _redeclare(step: Path, shape: list[int], dtype: str = "float32") -> None:
    path = step / CHECKPOINT_METADATA
    meta = json.loads(path.read_text())
    meta["custom_metadata"]["ckptd"]["arrays"]["params.w"].update(shape=shape, dtype=dtype)
    path.write_text(json.dumps(meta))


def _copy(written: Path, tmp_path: Path) -> Path:
    import shutil

    root = tmp_path / "root"
    shutil.copytree(written, root)
    return root


def _adopted(root: Path, tmp_path: Path) -> Catalog:
    catalog = Catalog(Storage(str(root)), tmp_path / "catalog.sqlite3")
    catalog.rebuild()
    return catalog


def test_true_steps_have_no_contradiction_and_are_adopted(written: Path, tmp_path: Path) -> None:
    root = _copy(written, tmp_path)
    assert stored_contradictions(Storage(str(root)), str(root / "job" / "20")) == []
    catalog = _adopted(root, tmp_path)
    latest = catalog.latest_good("job")
    assert latest is not None and latest.step == 20


@pytest.mark.parametrize("shape,dtype", [([1048576, 1048576], "float32"), ([4, 8], "bfloat16")])
def test_a_step_redeclaring_an_array_is_quarantined_not_adopted(
        written: Path, tmp_path: Path, shape: list[int], dtype: str) -> None:
    root = _copy(written, tmp_path)
    _redeclare(root / "job" / "20", shape, dtype)
    storage = Storage(str(root))
    [problem] = stored_contradictions(storage, str(root / "job" / "20"))
    assert "params.w: declared" in problem
    catalog = _adopted(root, tmp_path)
    latest = catalog.latest_good("job")
    assert latest is not None and latest.step == 10
    info = catalog.step("job", 20)
    assert info is not None and info.state is StepState.QUARANTINED and "contradicts its data" in (info.reason or "")
    fallback = latest_good_on_storage(Storage(str(root)), str(root / "job"))
    assert fallback is not None and fallback.step == 10


def test_the_storage_only_answer_passes_over_a_contradicting_step(written: Path, tmp_path: Path) -> None:
    root = _copy(written, tmp_path)
    _redeclare(root / "job" / "20", [1048576, 1048576])
    fallback = latest_good_on_storage(Storage(str(root)), str(root / "job"))
    assert fallback is not None and fallback.step == 10


class _Index:
    """An OCDBT index as ``_extent_problems`` reads it: keys, value lengths, the zarr documents."""

    def __init__(self, zarray: dict[str, Any], chunks: dict[str, int]) -> None:
        self.docs = {"params.w/.zarray": json.dumps(zarray).encode()}
        self.values = {key: ValueRef(None, 0, len(raw), raw) for key, raw in self.docs.items()}
        self.values.update({f"params.w/{name}": ValueRef(Path("d/x"), 0, n) for name, n in chunks.items()})

    def read(self, key: str) -> bytes:
        return self.docs[key]


ZARRAY = {"shape": [4, 8], "chunks": [4, 4], "dtype": "<f4", "compressor": {"id": "zstd", "level": 1},
          "zarr_format": 2}


@pytest.mark.parametrize("zarray,chunks,said", [
    (ZARRAY, {"0.0": 40, "0.1": 64}, None),
    (ZARRAY, {"0.0": 40, "0.2": 40}, "outside params.w's chunk grid [1, 2]"),
    (ZARRAY, {"0.0": 5000}, "more than a chunk of params.w (64 bytes raw) compresses to"),
    ({**ZARRAY, "compressor": None}, {"0.0": 64, "0.1": 40}, "an uncompressed chunk of params.w is 64"),
    # a shape no float holds (JSON allows any number of digits): its grid is counted exactly, no OverflowError
    ({**ZARRAY, "shape": [10**400, 8]}, {"0.0": 40, "0.2": 40}, f"outside params.w's chunk grid [{10**400 // 4}, 2]"),
    ({**ZARRAY, "shape": [10**400, 8]}, {"0.0": 40, f"{10**400 // 4 - 1}.1": 40}, None),
    ({**ZARRAY, "shape": [2**53 + 1, 8], "chunks": [1, 4]}, {f"{2**53}.0": 40, "0.1": 64}, None),
])
def test_chunks_past_what_the_zarr_metadata_allows_are_contradictions(
        zarray: dict[str, Any], chunks: dict[str, int], said: str | None) -> None:
    problems = _extent_problems(Path("default"), cast(OcdbtIndex, _Index(zarray, chunks)))
    assert problems == [] if said is None else (len(problems) == 1 and said in problems[0]), problems
