"""trainer_client.core.format._array_index against real Orbax checkpoints: every layout Orbax 0.12.8 writes.

Checkpoints are written in this process (conftest gives it 8 fake CPU devices) by a plain Orbax
CheckpointManager on a ("replica", "data") = (4, 2) mesh: OCDBT on/off x zarr v2/v3, and OCDBT + zarr v2
(Orbax's default) on ``gs://`` against fake-gcs-server. Expected names are built from the pytree's key
paths here and cross-checked against Orbax's own ``_sharding`` and ``_METADATA`` keys.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tests.support.gcs_emulator import GcsEmulator
from trainer_client.core._dtypes import dtype_itemsize, normalize_dtype
from trainer_client.core.format import _array_index as array_index
from trainer_client.core.format import _item_keys as item_keys
from trainer_client.core.format._array_index import ArrayInfo, decode_all_arrays, read_array_index
from trainer_client.errors import ArrayIndexError

STEP = 7


# ---- the state and what the index must say about it ------------------------------------------------


def _mesh() -> jax.sharding.Mesh:
    assert jax.device_count() == 8, jax.device_count()
    return jax.make_mesh((4, 2), ("replica", "data"))


def make_state() -> dict[str, Any]:
    """Mixed dtypes, nested dict, a list and a tuple, an optax adam state, scalars; sharded on (4, 2)."""
    mesh = _mesh()

    def put(x: jax.Array, spec: P) -> jax.Array:
        return jax.device_put(x, NamedSharding(mesh, spec))

    params = {
        "w": put(jnp.arange(8 * 16, dtype=jnp.float32).reshape(8, 16), P("replica", "data")),
        "b": put(jnp.ones((16,), jnp.bfloat16), P("data")),
        "blocks": [
            {"k": put(jnp.ones((4, 6), jnp.bfloat16), P("replica", None)), "v": put(jnp.ones((6,), jnp.float32), P())},
            (put(jnp.ones((2, 8), jnp.int8), P(None, "data")), put(jnp.ones((3, 3), jnp.float16), P())),
        ],
    }
    opt_state = optax.adam(1e-3).init(params)
    return {
        "params": params,
        "opt": opt_state,
        "step": put(jnp.int32(STEP), P()),
        "host": {"np": np.arange(6, dtype=np.int16).reshape(2, 3), "lr": 0.5},
        "nothing": None,
        "empty": {},
    }


def _key_name(key: Any) -> str:
    """Orbax's string for one key-path entry, written out here rather than taken from Orbax."""
    if isinstance(key, jax.tree_util.DictKey):
        return str(key.key)
    if isinstance(key, jax.tree_util.SequenceKey):
        return str(key.idx)
    if isinstance(key, jax.tree_util.GetAttrKey):
        return key.name
    raise AssertionError(f"unexpected key {key!r}")


def expected_index(state: Any) -> dict[str, ArrayInfo]:
    out: dict[str, ArrayInfo] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        name = ".".join(_key_name(k) for k in path)
        if isinstance(leaf, jax.Array | np.ndarray):
            out[name] = ArrayInfo(tuple(leaf.shape), np.dtype(leaf.dtype).name)
        elif isinstance(leaf, float):
            out[name] = ArrayInfo((), "float64")  # Orbax stores a Python float as a 0-d float64 array
    return out


def sharding_names(item_dir: Path) -> set[str]:
    raw = json.loads((item_dir / "_sharding").read_text())
    return {base64.b64decode(k).decode() for k in raw}


def metadata_names(item_dir: Path) -> set[str]:
    """Leaves ``_METADATA`` says carry a value (None and empty nodes, like optax's EmptyState, do not)."""
    tree = json.loads((item_dir / "_METADATA").read_text())["tree_metadata"]
    return {
        ".".join(str(k["key"]) for k in entry["key_metadata"])
        for entry in tree.values()
        if not entry["value_metadata"]["skip_deserialize"]
    }


# ---- writing with plain Orbax ----------------------------------------------------------------------

LAYOUTS: dict[str, Callable[[], tuple[Any, Any]]] = {
    # name: () -> (item handler, save-args class)
    "ocdbt-zarr2": lambda: (ocp.StandardCheckpointHandler(), ocp.args.StandardSave),
    "ocdbt-zarr3": lambda: (ocp.PyTreeCheckpointHandler(use_zarr3=True), ocp.args.PyTreeSave),
    "dirs-zarr2": lambda: (ocp.StandardCheckpointHandler(use_ocdbt=False), ocp.args.StandardSave),
    "dirs-zarr3": lambda: (ocp.PyTreeCheckpointHandler(use_ocdbt=False, use_zarr3=True), ocp.args.PyTreeSave),
}


def save_step(job: str | Path, state: Any, layout: str = "ocdbt-zarr2", step: int = STEP) -> None:
    handler, args = LAYOUTS[layout]()
    mgr = ocp.CheckpointManager(job, item_handlers=handler)
    try:
        mgr.save(step, args=args(state))
        mgr.wait_until_finished()
    finally:
        mgr.close()


@pytest.fixture(scope="module")
def state() -> dict[str, Any]:
    return make_state()


@pytest.fixture(scope="module")
def steps(state: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One committed step per layout: layout name -> step directory."""
    root = tmp_path_factory.mktemp("array-index")
    out = {}
    for layout in LAYOUTS:
        save_step(root / layout, state, layout)
        out[layout] = root / layout / str(STEP)
    return out


# ---- every layout ----------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_index_matches_every_leaf(layout: str, steps: dict[str, Path], state: dict[str, Any]) -> None:
    step_dir = steps[layout]
    item = step_dir / "default"
    assert (step_dir / "commit_success.txt").exists()
    # the layout really is the one named
    on_disk_zarr = {p.name for p in item.rglob("*") if p.name in (".zarray", "zarr.json")}
    meta = json.loads((item / "_METADATA").read_text())
    assert meta["use_zarr3"] is layout.endswith("zarr3")
    if layout.startswith("ocdbt"):
        assert (item / "manifest.ocdbt").exists() and not on_disk_zarr
    else:
        assert not (item / "manifest.ocdbt").exists()
        assert on_disk_zarr == ({"zarr.json"} if layout.endswith("zarr3") else {".zarray"})

    index = read_array_index(str(step_dir))

    expected = expected_index(state)
    assert index == expected
    assert list(index) == sorted(index)
    # names are Orbax's: those of _sharding (jax.Array leaves) and of _METADATA's tree
    assert sharding_names(item) == {n for n in expected if not n.startswith("host.")}
    assert set(index) == metadata_names(item)
    # spot checks, spelled out
    assert index["params.w"] == ArrayInfo((8, 16), "float32")
    assert index["params.b"] == ArrayInfo((16,), "bfloat16")
    assert index["params.blocks.1.0"] == ArrayInfo((2, 8), "int8")
    assert index["opt.0.mu.blocks.0.k"] == ArrayInfo((4, 6), "bfloat16")
    assert index["opt.0.count"] == ArrayInfo((), "int32")
    assert index["step"] == ArrayInfo((), "int32")
    assert index["host.np"] == ArrayInfo((2, 3), "int16")
    assert "nothing" not in index and "empty" not in index
    # the names are ones jax accepts as dtypes, and they round-trip to the saved leaves' dtypes
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        if isinstance(leaf, jax.Array):
            assert jnp.dtype(index[".".join(_key_name(k) for k in path)].dtype) == leaf.dtype


def test_index_drives_a_restore(steps: dict[str, Path], state: dict[str, Any]) -> None:
    """What the planner does with it: ShapeDtypeStructs from the index restore the plain-Orbax step."""
    index = read_array_index(steps["ocdbt-zarr2"])
    mesh = _mesh()
    replicated = NamedSharding(mesh, P())

    def target(path: Any, leaf: Any) -> Any:
        if not isinstance(leaf, jax.Array):
            return leaf
        info = index[".".join(_key_name(k) for k in path)]
        return jax.ShapeDtypeStruct(info.shape, jnp.dtype(info.dtype), sharding=replicated)

    abstract = jax.tree_util.tree_map_with_path(target, state)
    mgr = ocp.CheckpointManager(steps["ocdbt-zarr2"].parent)
    try:
        restored = mgr.restore(STEP, args=ocp.args.StandardRestore(abstract))
    finally:
        mgr.close()
    assert np.array_equal(np.asarray(restored["params"]["w"]), np.asarray(state["params"]["w"]))
    assert restored["params"]["b"].dtype == jnp.bfloat16


def test_accepts_file_url_path_object_and_trailing_slash(steps: dict[str, Path]) -> None:
    step_dir = steps["ocdbt-zarr2"]
    plain = read_array_index(str(step_dir))
    assert read_array_index(step_dir) == plain
    assert read_array_index(f"file://{step_dir}/") == plain


# ---- errors ----------------------------------------------------------------------------------------


def _copy_step(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_corrupt_zarray_in_a_directory(steps: dict[str, Path], tmp_path: Path) -> None:
    step_dir = _copy_step(steps["dirs-zarr2"], tmp_path / "s")
    (step_dir / "default" / "params.w" / ".zarray").write_text('{"shape": [8, 16], "dtype": ')
    with pytest.raises(ArrayIndexError, match=r"params\.w/\.zarray") as err:
        read_array_index(str(step_dir))
    assert isinstance(err.value, ValueError)


@pytest.mark.parametrize(
    "document",
    [
        b"{not json",
        b"[1, 2]",
        b'{"shape": [8, 16]}',
        b'{"shape": [8, -1], "dtype": "<f4"}',
        b'{"shape": [8, 16], "dtype": "<U4"}',
        b'{"shape": "8x16", "dtype": "<f4"}',
    ],
)
def test_corrupt_zarray_inside_ocdbt(document: bytes, steps: dict[str, Path], tmp_path: Path) -> None:
    step_dir = _copy_step(steps["ocdbt-zarr2"], tmp_path / "s")
    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{step_dir}/default/"}).result()
    kv.write("params.w/.zarray", document).result()
    with pytest.raises(ArrayIndexError, match=r"corrupt array metadata params\.w/\.zarray in OCDBT store"):
        read_array_index(str(step_dir))


def test_corrupt_zarr3_metadata(steps: dict[str, Path], tmp_path: Path) -> None:
    step_dir = _copy_step(steps["dirs-zarr3"], tmp_path / "s")
    path = step_dir / "default" / "opt.0.nu.w" / "zarr.json"
    doc = json.loads(path.read_text())
    doc["data_type"] = "no_such_type"
    path.write_text(json.dumps(doc))
    with pytest.raises(ArrayIndexError, match=r"opt\.0\.nu\.w/zarr\.json.*no_such_type"):
        read_array_index(str(step_dir))


def test_missing_array_metadata_is_reported(steps: dict[str, Path], tmp_path: Path) -> None:
    step_dir = _copy_step(steps["dirs-zarr2"], tmp_path / "s")
    (step_dir / "default" / "params.b" / ".zarray").unlink()
    with pytest.raises(ArrayIndexError, match=r"1 array\(s\) listed in .*_METADATA.*params\.b"):
        read_array_index(str(step_dir))


def test_corrupt_ocdbt_manifest(steps: dict[str, Path], tmp_path: Path) -> None:
    step_dir = _copy_step(steps["ocdbt-zarr2"], tmp_path / "s")
    (step_dir / "default" / "manifest.ocdbt").write_bytes(b"garbage")
    with pytest.raises(ArrayIndexError, match="cannot read"):
        read_array_index(str(step_dir))


def test_unmerged_ocdbt_is_an_unfinished_save(steps: dict[str, Path], tmp_path: Path) -> None:
    step_dir = _copy_step(steps["ocdbt-zarr2"], tmp_path / "s")
    (step_dir / "default" / "manifest.ocdbt").unlink()
    with pytest.raises(ArrayIndexError, match="per-process OCDBT"):
        read_array_index(str(step_dir))


def test_missing_step_item_or_bad_url(steps: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ArrayIndexError, match="no Orbax item"):
        read_array_index(str(tmp_path / "no-such-step"))
    with pytest.raises(ArrayIndexError, match="no Orbax item"):
        read_array_index(str(steps["ocdbt-zarr2"]), item="other")
    (tmp_path / "junk" / "default").mkdir(parents=True)
    (tmp_path / "junk" / "default" / "x.txt").write_text("hi")
    with pytest.raises(ArrayIndexError, match="no Orbax item"):
        read_array_index(str(tmp_path / "junk"))
    for bad in ("s3://bucket/x", "gs:///x"):
        with pytest.raises(ArrayIndexError):
            read_array_index(bad)
    with pytest.raises(ArrayIndexError, match="invalid item"):
        read_array_index(str(steps["ocdbt-zarr2"]), item="../x")


# ---- decoding every chunk (ckptd validate --deep) --------------------------------------------------


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_decode_all_arrays_on_good_steps(layout: str, steps: dict[str, Path]) -> None:
    assert decode_all_arrays(str(steps[layout])) == []


def test_decode_reads_every_slab(steps: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Slabs of whole chunks along axis 0: with tiny slabs the last chunk of params.w is still read."""
    step_dir = _copy_step(steps["dirs-zarr2"], tmp_path / "s")
    monkeypatch.setattr(array_index, "_DECODE_SLAB_BYTES", 64)
    assert decode_all_arrays(str(step_dir)) == []
    chunk = step_dir / "default" / "params.w" / "3.1"  # f32[8, 16] on (4, 2): chunks of 2 x 8
    chunk.write_bytes(chunk.read_bytes()[:5])
    problems = decode_all_arrays(str(step_dir))
    assert len(problems) == 1 and "params.w: cannot decode" in problems[0], problems


def test_decode_finds_a_truncated_ocdbt_data_file(tmp_path: Path) -> None:
    state = {
        "big": jnp.asarray(np.random.default_rng(0).standard_normal((256, 256), dtype=np.float32)),
        "small": jnp.ones((3,)),
    }
    save_step(tmp_path / "job", state)
    step_dir = tmp_path / "job" / str(STEP)
    data = max((step_dir / "default").glob("ocdbt.process_*/d/*"), key=lambda p: p.stat().st_size)
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    assert read_array_index(str(step_dir))["big"] == ArrayInfo((256, 256), "float32")  # metadata intact
    problems = decode_all_arrays(str(step_dir))
    assert len(problems) == 1 and "big: cannot decode" in problems[0], problems


# ---- dtypes ----------------------------------------------------------------------------------------


def test_dtype_names_and_itemsizes() -> None:
    assert normalize_dtype("<f4") == "float32"
    assert normalize_dtype(">f4") == "float32"
    assert normalize_dtype("|b1") == "bool"
    assert normalize_dtype("|i1") == "int8"
    assert normalize_dtype("<c8") == "complex64"
    assert normalize_dtype("bfloat16") == "bfloat16"
    assert normalize_dtype("float8_e4m3fn") == "float8_e4m3fn"
    assert normalize_dtype("int32") == "int32"
    sizes = {
        "bfloat16": 2,
        "float8_e4m3fn": 1,
        "float8_e5m2": 1,
        "int4": 1,
        "uint4": 1,
        "float32": 4,
        "int32": 4,
        "int64": 8,
        "float16": 2,
        "bool": 1,
        "complex64": 8,
        "uint8": 1,
        "<f8": 8,
    }
    assert {k: dtype_itemsize(k) for k in sizes} == sizes
    for bad in ("", "no_such_type", "<U4", "|O", "|V8"):
        with pytest.raises(ValueError):
            dtype_itemsize(bad)
    assert ArrayInfo((8, 16), "bfloat16").nbytes == 256
    assert ArrayInfo((), "int32").nbytes == 4


def test_extension_dtypes_round_trip(tmp_path: Path) -> None:
    """float8 / int4 / bool / complex leaves: zarr v2 and v3 spell them differently; the index does not."""
    mesh = _mesh()
    state = {
        "f8": jax.device_put(jnp.ones((8,), jnp.float8_e4m3fn), NamedSharding(mesh, P("replica"))),
        "i4": jnp.ones((5,), jnp.int4),
        "flag": jnp.ones((2,), bool),
        "c": jnp.ones((2,), jnp.complex64),
    }
    want = {
        "c": ArrayInfo((2,), "complex64"),
        "f8": ArrayInfo((8,), "float8_e4m3fn"),
        "flag": ArrayInfo((2,), "bool"),
        "i4": ArrayInfo((5,), "int4"),
    }
    for layout in ("ocdbt-zarr2", "dirs-zarr3"):
        save_step(tmp_path / layout, state, layout)
        assert read_array_index(str(tmp_path / layout / str(STEP))) == want, layout


# ---- speed and house rules -------------------------------------------------------------------------


def test_reading_200_arrays_is_fast(tmp_path: Path) -> None:
    mesh = _mesh()
    sharding = NamedSharding(mesh, P("replica", "data"))
    params = {f"layer_{i:02d}": jax.device_put(jnp.full((64, 32), i, jnp.float32), sharding) for i in range(66)}
    state = {"params": params, "opt": optax.adam(1e-3).init(params), "step": jnp.int32(1)}
    n_arrays = len(jax.tree.leaves(state))
    assert 195 <= n_arrays <= 205, n_arrays
    t0 = time.perf_counter()
    save_step(tmp_path / "job", state)
    save_s = time.perf_counter() - t0
    step_dir = str(tmp_path / "job" / str(STEP))
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        index = read_array_index(step_dir)
        times.append(time.perf_counter() - t0)
    assert len(index) == n_arrays
    median = statistics.median(times)
    print(
        f"\narray index: {n_arrays} arrays, read in {median * 1000:.1f} ms median "
        f"(min {min(times) * 1000:.1f}, max {max(times) * 1000:.1f}); Orbax save took {save_s:.2f} s"
    )
    assert median < 1.0


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_local_items_read_without_tensorstore_as_tensorstore_reads_them(layout: str, steps: dict[str, Path]) -> None:
    """The local reader (ckptd's own OCDBT index, plain files) finds the same documents as tensorstore."""
    spec = item_keys.item_kvstore_spec(steps[layout], "default")
    local = item_keys._fetch_local(spec)
    assert local is not None, "the local reader gave up on an item plain Orbax wrote"
    use_ocdbt, documents, metadata = local
    ts_ocdbt, ts_documents, ts_metadata = item_keys._fetch_with_tensorstore(spec, 60)
    assert (use_ocdbt, metadata) == (ts_ocdbt, ts_metadata)
    assert sorted(documents) == sorted(ts_documents) and documents


@pytest.mark.parametrize("planted", ["link to /dev/zero", "fifo", "oversized"])
def test_a_planted_metadata_file_is_refused_not_read_forever(planted: str, steps: dict[str, Path],
                                                              tmp_path: Path) -> None:
    """A metadata document in a plain-zarr item that is a link to an endless device, a FIFO nobody
    writes, or a file of gigabytes: the sidecar reads it, so it must refuse it at once."""
    step_dir = _copy_step(steps["dirs-zarr2"], tmp_path / "s")
    document = step_dir / "default" / "params.b" / ".zarray"
    document.unlink()
    if planted == "fifo":
        os.mkfifo(document)
    elif planted == "oversized":
        with document.open("wb") as f:
            f.truncate(item_keys.MAX_DOCUMENT_BYTES + 1)
    else:
        document.symlink_to("/dev/zero")
    with pytest.raises(ArrayIndexError, match="larger than" if planted == "oversized" else "cannot read|corrupt"):
        read_array_index(str(step_dir), timeout=10)


def test_a_local_index_loads_no_tensorstore(steps: dict[str, Path]) -> None:
    """What the sidecar does for a step of plain Orbax on a local root: no tensorstore in the process."""
    code = (
        "import sys\n"
        "from trainer_client.core.format._array_index import read_array_index\n"
        "for step in sys.argv[1:]:\n"
        "    assert read_array_index(step), step\n"
        "assert 'tensorstore' not in sys.modules, 'tensorstore imported'\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code, *map(str, steps.values())], capture_output=True, text=True,
                         check=False, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_module_does_not_import_jax() -> None:
    code = (
        "import sys\n"
        "import trainer_client.core.format._array_index\n"
        "assert not any(m == 'jax' or m.startswith('jax.') for m in sys.modules), 'jax imported'\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


# ---- gs:// -----------------------------------------------------------------------------------------


@pytest.mark.integration
def test_gcs_step_matches_local(gcs_emulator: GcsEmulator, state: dict[str, Any], steps: dict[str, Path]) -> None:
    """Orbax (in this process) saves to gs:// on fake-gcs-server; the index reads it through tensorstore's gcs
    driver, which TENSORSTORE_GCS_HTTP_URL points at the emulator."""
    local = read_array_index(str(steps["ocdbt-zarr2"]))
    for layout in ("ocdbt-zarr2", "dirs-zarr3"):
        job = gcs_emulator.gs("array-index", layout)
        save_step(job, state, layout)
        step_url = f"{job}/{STEP}"
        t0 = time.perf_counter()
        index = read_array_index(step_url)
        print(f"\ngs:// {layout}: {len(index)} arrays in {(time.perf_counter() - t0) * 1000:.1f} ms")
        assert index == local, layout
        assert decode_all_arrays(step_url) == [], layout
    with pytest.raises(ArrayIndexError, match="no Orbax item"):
        read_array_index(gcs_emulator.gs("array-index", "ocdbt-zarr2", "999"))


def test_key_naming_edge_cases(tmp_path: Path) -> None:
    """Orbax joins keys with "." without escaping: a dict key holding "." or "/" stays in the name as is
    (and a "/" becomes a directory level in the store). The index reports exactly Orbax's names."""
    mesh = _mesh()
    sharded = NamedSharding(mesh, P("replica"))
    state = {
        "a.b": jax.device_put(jnp.ones((8,)), sharded),
        "a": {"c": jnp.ones((2,))},
        "c": jnp.ones((3,)),
        "c/d": jnp.ones((4,), jnp.bfloat16),
        "3": [jnp.int32(1)],
    }
    want = {
        "3.0": ArrayInfo((), "int32"),
        "a.b": ArrayInfo((8,), "float32"),
        "a.c": ArrayInfo((2,), "float32"),
        "c": ArrayInfo((3,), "float32"),
        "c/d": ArrayInfo((4,), "bfloat16"),
    }
    for layout in ("ocdbt-zarr2", "dirs-zarr2"):
        save_step(tmp_path / layout, state, layout)
        step_dir = tmp_path / layout / str(STEP)
        index = read_array_index(str(step_dir))
        assert index == want, layout
        assert sharding_names(step_dir / "default") == set(want), layout
