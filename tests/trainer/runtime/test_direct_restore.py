"""The direct restore path reads real Orbax checkpoints exactly as Orbax does, and steps aside when it cannot.

The OCDBT index reader is checked key for key and byte for byte against tensorstore's own reader, on
databases written by tensorstore with tiny nodes (a B+tree several levels deep, inline and out-of-line
values, many versions, zstd and uncompressed nodes). Restores are checked shard for shard against Orbax's
``StandardCheckpointer.restore`` of the same step onto every kind of target sharding.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorstore as ts
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tests.support.helpers import REPO, free_port
from trainer_client.core._storage import Storage
from trainer_client.core._validation import validate_step
from trainer_client.core.format._ocdbt_index import OcdbtIndex
from trainer_client.errors import DirectRestoreUnsupported, OcdbtFormatError
from trainer_client.runtime.restore._direct_restore import restore_direct
from trainer_client.runtime.saving._checkpointing import Checkpointer, leaf_name, restore

SHAPES = {"w": (240, 40), "b": (120,), "emb": (96, 3), "step": ()}
DTYPES = {"w": np.float32, "b": jnp.bfloat16, "emb": np.float32, "step": np.int32}


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Mesh:
    return Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), names)


def _values() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {name: np.asarray(rng.standard_normal(shape) * 10).astype(DTYPES[name]) for name, shape in SHAPES.items()}


def _save(directory: Path, *, compression: bool = False) -> dict[str, np.ndarray]:
    mesh = _mesh((4, 2), ("replica", "data"))
    specs = {"w": P("replica", "data"), "b": P("data"), "emb": P(), "step": P()}
    values = _values()
    state = {"params": {k: jax.device_put(values[k], NamedSharding(mesh, specs[k])) for k in ("w", "b", "emb")},
             "step": jax.device_put(values["step"], NamedSharding(mesh, P()))}
    ck = Checkpointer(str(directory), async_save=False, compression=compression)
    ck.save(3, state, data_position=0, global_batch=8, mesh=mesh, slices=[])
    ck.close()
    return values


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    root = tmp_path_factory.mktemp("direct") / "job"
    return root / "3", _save(root)


def _target(mesh: Mesh, specs: dict[str, P], dtypes: dict[str, object] | None = None) -> dict[str, object]:
    dtypes = dtypes or DTYPES

    def leaf(name: str) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(SHAPES[name], dtypes[name], sharding=NamedSharding(mesh, specs.get(name, P())))

    return {"params": {k: leaf(k) for k in ("w", "b", "emb")}, "step": leaf("step")}


TARGETS = {
    "as saved": ((4, 2), ("replica", "data"), {"w": P("replica", "data"), "b": P("data")}),
    "rows over 6": ((6,), ("data",), {"w": P("data"), "b": P("data"), "emb": P("data")}),
    "columns over 8": ((8,), ("data",), {"w": P(None, "data"), "b": P("data")}),
    "2-d over 3x2": ((3, 2), ("a", "b"), {"w": P("a", "b"), "emb": P("b")}),
    "columns over 5": ((5,), ("data",), {"w": P(None, "data"), "b": P("data")}),
    "replicated": ((8,), ("data",), {}),
    "one device": ((1,), ("data",), {"w": P("data")}),
}


@pytest.mark.parametrize("case", sorted(TARGETS))
@pytest.mark.needs_devices(8)
def test_direct_restore_matches_orbax_shard_for_shard(saved: tuple[Path, dict[str, np.ndarray]], case: str) -> None:
    step_dir, values = saved
    mesh_shape, names, specs = TARGETS[case]
    target = _target(_mesh(mesh_shape, names), specs)
    direct = restore_direct(step_dir / "default", target, leaf_name)
    orbax = restore(str(step_dir), target, direct=False)
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(direct), jax.tree_util.tree_leaves(orbax),
                                 strict=True):
        name = leaf_name(path).split(".")[-1]
        assert got.sharding == want.sharding and got.dtype == want.dtype, name
        assert np.array_equal(np.asarray(got), values[name]), name
        for mine, theirs in zip(got.addressable_shards, want.addressable_shards, strict=True):
            assert mine.device == theirs.device and mine.index == theirs.index
            assert np.array_equal(np.asarray(mine.data), np.asarray(theirs.data)), (name, mine.index)


@pytest.mark.needs_devices(8)
def test_arrays_read_a_batch_at_a_time_are_the_same(saved: tuple[Path, dict[str, np.ndarray]]) -> None:
    # on accelerators the host holds a bounded batch of buffers at once; one byte forces one array per batch
    step_dir, values = saved
    out = restore_direct(step_dir / "default", _target(_mesh((6,), ("data",)), {"w": P("data")}), leaf_name,
                         host_batch_bytes=1)
    for path, got in jax.tree_util.tree_leaves_with_path(out):
        assert np.array_equal(np.asarray(got), values[leaf_name(path).split(".")[-1]])


@pytest.mark.needs_devices(8)
def test_restore_takes_the_direct_path_for_a_ckptd_checkpoint(
    saved: tuple[Path, dict[str, np.ndarray]], caplog: pytest.LogCaptureFixture
) -> None:
    step_dir, values = saved
    with caplog.at_level(logging.INFO, logger="trainer_client.runtime.saving._checkpointing"):
        out = restore(str(step_dir), _target(_mesh((8,), ("data",)), {"w": P("data")}))
    assert "through Orbax" not in caplog.text
    assert np.array_equal(np.asarray(out["params"]["w"]), values["w"])


@pytest.mark.needs_devices(8)
def test_a_restored_buffer_donated_to_a_step_leaves_the_others_intact(
    saved: tuple[Path, dict[str, np.ndarray]],
) -> None:
    # Replicas share one host buffer (as jax shares one between replicas): a donating step must not corrupt them.
    step_dir, values = saved
    out = restore_direct(step_dir / "default", _target(_mesh((8,), ("data",)), {}), leaf_name)
    doubled = jax.jit(lambda x: x * 2, donate_argnums=0)(out["params"]["emb"])
    again = restore_direct(step_dir / "default", _target(_mesh((8,), ("data",)), {}), leaf_name)
    assert np.array_equal(np.asarray(doubled), values["emb"] * 2)
    assert np.array_equal(np.asarray(again["params"]["emb"]), values["emb"])


@pytest.mark.needs_devices(8)
def test_compressed_chunks_and_casting_targets_are_left_to_orbax(
    tmp_path: Path, saved: tuple[Path, dict[str, np.ndarray]], caplog: pytest.LogCaptureFixture
) -> None:
    values = _save(tmp_path / "zstd", compression=True)
    target = _target(_mesh((8,), ("data",)), {"w": P("data")})
    with pytest.raises(DirectRestoreUnsupported, match="compressor"):
        restore_direct(tmp_path / "zstd" / "3" / "default", target, leaf_name)
    with caplog.at_level(logging.INFO, logger="trainer_client.runtime.saving._checkpointing"):
        out = restore(str(tmp_path / "zstd" / "3"), target)
    assert "through Orbax" in caplog.text
    assert np.array_equal(np.asarray(out["params"]["w"]), values["w"])

    step_dir, values = saved
    cast = _target(_mesh((8,), ("data",)), {}, {**DTYPES, "w": jnp.bfloat16})
    with pytest.raises(DirectRestoreUnsupported, match="target is bfloat16"):
        restore_direct(step_dir / "default", cast, leaf_name)
    out = restore(str(step_dir), cast)  # Orbax casts, as it always did
    assert out["params"]["w"].dtype == jnp.bfloat16
    assert np.allclose(np.asarray(out["params"]["w"], np.float32), values["w"], rtol=1e-2)


@pytest.mark.needs_devices(8)
def test_a_damaged_index_or_data_file_is_refused_before_any_array_is_built(tmp_path: Path) -> None:
    _save(tmp_path / "job")
    item = tmp_path / "job" / "3" / "default"
    target = _target(_mesh((8,), ("data",)), {"w": P("data")})
    manifest = item / "manifest.ocdbt"
    good = manifest.read_bytes()
    manifest.write_bytes(good[:20] + bytes([good[20] ^ 0xFF]) + good[21:])
    with pytest.raises(DirectRestoreUnsupported, match="CRC-32C"):
        restore_direct(item, target, leaf_name)
    manifest.write_bytes(good)
    biggest = max((p for p in item.rglob("d/*") if p.is_file()), key=lambda p: p.stat().st_size)
    biggest.write_bytes(biggest.read_bytes()[: biggest.stat().st_size // 2])
    with pytest.raises(DirectRestoreUnsupported, match=r"ends before byte|wanted"):
        restore_direct(item, target, leaf_name)


def _ocdbt(root: Path, config: dict[str, object]) -> ts.KvStore:
    return ts.KvStore.open({"driver": "ocdbt", "base": f"file://{root}", "config": config}).result()


@pytest.mark.parametrize("compression", [{"id": "zstd"}, None])
def test_the_index_reader_agrees_with_tensorstore_on_a_deep_tree(tmp_path: Path, compression: object) -> None:
    store = _ocdbt(tmp_path, {"max_decoded_node_bytes": 600, "max_inline_value_bytes": 40, "compression": compression})
    rng = np.random.default_rng(1)
    expected: dict[str, bytes] = {}
    for version in range(20):  # many commits: older versions move into version-tree nodes
        with ts.Transaction() as txn:
            for i in range(25):
                key = f"array{rng.integers(0, 60):03d}/{version}.{i}"
                value = rng.bytes(int(rng.choice([0, 5, 39, 41, 300, 5000])))
                store.with_transaction(txn)[key] = value
                expected[key] = value
        if version == 10:
            store.with_transaction(None)["array000/overwritten"] = b"old value, replaced later"
    store["array000/overwritten"] = b"the latest value"
    expected["array000/overwritten"] = b"the latest value"

    index = OcdbtIndex(tmp_path)
    assert sorted(index.values) == sorted(expected)
    assert sorted(k.decode() for k in store.list().result()) == sorted(expected)
    for key, value in expected.items():
        assert index.read(key) == value, key
    inline = [ref for ref in index.values.values() if ref.inline is not None]
    assert inline and len(inline) < len(index.values)  # both kinds of value were exercised
    assert index.height >= 2  # interior nodes of two levels were walked


def test_an_unknown_or_damaged_manifest_raises_the_format_error(tmp_path: Path) -> None:
    store = _ocdbt(tmp_path, {})
    store["k"] = b"v" * 100
    manifest = tmp_path / "manifest.ocdbt"
    good = manifest.read_bytes()
    assert OcdbtIndex(tmp_path).read("k") == b"v" * 100
    manifest.write_bytes(b"\x00" + good[1:])
    with pytest.raises(OcdbtFormatError, match="magic"):
        OcdbtIndex(tmp_path)
    manifest.write_bytes(good[:-10])
    with pytest.raises(OcdbtFormatError, match="header says"):
        OcdbtIndex(tmp_path)
    manifest.unlink()
    with pytest.raises(OcdbtFormatError, match="No such file"):
        OcdbtIndex(tmp_path)


def test_a_data_file_path_that_leaves_the_database_is_refused(tmp_path: Path) -> None:
    import google_crc32c
    import zstandard

    store = _ocdbt(tmp_path, {"max_inline_value_bytes": 0})
    store["k"] = b"v" * 100
    manifest = tmp_path / "manifest.ocdbt"
    raw = manifest.read_bytes()
    body = zstandard.ZstdDecompressor().decompress(raw[14:-4], max_output_size=1 << 20)
    name = next(p.name for p in (tmp_path / "d").iterdir())
    evil = body.replace(f"d/{name}".encode(), f"../{name[:-1]}".encode().ljust(len(name) + 2, b"x"))
    assert evil != body
    packed = raw[:12] + bytes([0, 0]) + evil  # version 0, uncompressed
    packed = packed[:4] + (len(packed) + 4).to_bytes(8, "little") + packed[12:]
    manifest.write_bytes(packed + google_crc32c.value(packed).to_bytes(4, "little"))
    with pytest.raises(OcdbtFormatError, match="leaves the database"):
        OcdbtIndex(tmp_path)


@pytest.mark.needs_tcp
def test_a_step_saved_by_two_processes_is_read_back_by_each(tmp_path: Path) -> None:
    # Two JAX processes (4 CPU devices each) save one step together — Orbax writes a database per process
    # and merges them under one manifest — then each reads the shards it holds onto another mesh. The step
    # carries one ckptd manifest, written by the primary process, and it validates.
    worker = REPO / "tests" / "support" / "multiprocess_worker.py"
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(worker), str(i), str(port), str(tmp_path / "job")],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=240)
            outputs.append(out)
    finally:
        for proc in procs:
            proc.kill()
    for i, (proc, out) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0 and f"{i} ok" in out, out[-3000:]
    item = tmp_path / "job" / "1" / "default"
    assert {p.name for p in item.glob("ocdbt.process_*")} == {"ocdbt.process_0", "ocdbt.process_1"}
    written = {ref.path.relative_to(item).parts[0] for ref in OcdbtIndex(item).values.values() if ref.path}
    assert written == {"ocdbt.process_0", "ocdbt.process_1"}  # values of both processes, one index
    result = validate_step(Storage(str(tmp_path / "job")), str(tmp_path / "job" / "1"), "quick")
    assert result.ok, result.problems
    assert not list((tmp_path / "job" / "1").glob("*.tmp-*"))


class _OneArrayIndex:
    """An index holding one ``.zarray`` document (what ``_ZarrArray.open`` reads of it)."""

    def __init__(self, zarray: str) -> None:
        self.zarray = zarray.encode()

    def read(self, key: str) -> bytes:
        return self.zarray


@pytest.mark.parametrize(("dtype", "fill"), [("<f4", "1" + "0" * 400), ("<i4", "1" + "0" * 400), ("<i4", "1e400"),
                                             ("|i1", "300"), ("<i4", "NaN"), ("bfloat16", "-1" + "0" * 400)])
def test_a_fill_value_its_dtype_cannot_hold_leaves_the_restore_to_orbax(dtype: str, fill: str) -> None:
    from trainer_client.runtime.restore._direct_restore import _ZarrArray

    doc = ('{"zarr_format": 2, "compressor": null, "filters": null, "order": "C", "shape": [4], "chunks": [4], '
           f'"dtype": "{dtype}", "fill_value": {fill}}}')
    with pytest.raises(DirectRestoreUnsupported, match="fill value"):  # not an OverflowError mid-restore
        _ZarrArray.open(_OneArrayIndex(doc), "w")  # type: ignore[arg-type]
    fine = doc.replace(f'"fill_value": {fill}', '"fill_value": 0')
    assert _ZarrArray.open(_OneArrayIndex(fine), "w").fill == 0  # type: ignore[arg-type]
