"""The OCDBT index reader against hostile databases: it reads bytes from storage that nobody vouches for
(the trainer's direct restore, the sidecar's zarr index), so every malformed input is its own
``OcdbtFormatError`` (the caller then falls back to tensorstore), in bounded time and memory.

The databases here are written byte by byte in tensorstore's published format (``_Db``), which is how a
forged one would be made; tests/trainer/test_direct_restore.py checks the reader against tensorstore's own.
"""

from __future__ import annotations

import resource
import time
from pathlib import Path

import google_crc32c
import pytest
import zstandard

from trainer_client.core.errors import OcdbtFormatError
from trainer_client.core.format.ocdbt_index import OcdbtIndex

MANIFEST_MAGIC, BTREE_MAGIC = 0x0CDB3A2A, 0x0CDB20DE
DATA = "d/nodes"


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _varints(values: list[int]) -> bytes:
    return b"".join(_varint(v) for v in values)


def _frame(magic: int, body: bytes, *, compress: bool = False) -> bytes:
    """A node as stored: magic, length, format version 0, compression, body, CRC-32C."""
    payload = zstandard.ZstdCompressor().compress(body) if compress else body
    head = _varint(0) + _varint(1 if compress else 0)
    length = 4 + 8 + len(head) + len(payload) + 4
    raw = magic.to_bytes(4, "big") + length.to_bytes(8, "little") + head + payload
    return raw + google_crc32c.value(raw).to_bytes(4, "little")


def _table(paths: list[str]) -> bytes:
    encoded = [p.encode() for p in paths]
    return (_varint(len(encoded)) + _varints([0] * max(len(encoded) - 1, 0)) + _varints([len(p) for p in encoded])
            + _varints([0] * len(encoded)) + b"".join(encoded))


def _keys(keys: list[bytes]) -> bytes:
    return _varints([0] * max(len(keys) - 1, 0)) + _varints([len(k) for k in keys])


def leaf(items: dict[bytes, bytes]) -> bytes:
    """A leaf node holding ``items`` inline."""
    keys = sorted(items)
    return (b"\x00" + _table([]) + _varint(len(keys)) + _keys(keys) + b"".join(keys)
            + _varints([len(items[k]) for k in keys]) + _varints([0] * len(keys)) + b"".join(items[k] for k in keys))


def interior(height: int, children: list[tuple[bytes, int, int]]) -> bytes:
    """An interior node: ``(first key, offset, length)`` per child, all in data file 0 (``DATA``)."""
    keys = [c[0] for c in children]
    n = len(children)
    return (bytes([height]) + _table([DATA]) + _varint(n) + _keys(keys) + _varints([0] * n) + b"".join(keys)
            + _varints([0] * n) + _varints([c[1] for c in children]) + _varints([c[2] for c in children])
            + _varints([0] * 3 * n))


def manifest(root: tuple[int, int], height: int, *, max_decoded: int = 8 << 20) -> bytes:
    """A manifest whose one version's root node is ``(offset, length)`` in ``DATA``."""
    body = (bytes(16) + _varint(0) + _varint(100) + _varint(max_decoded) + b"\x04" + _varint(0) + _table([DATA])
            + _varint(1) + _varint(1) + bytes([height]) + _varint(0) + _varint(root[0]) + _varint(root[1])
            + _varints([0, 0, 0]) + (0).to_bytes(8, "little"))
    return _frame(MANIFEST_MAGIC, body)


class _Db:
    """A database under construction: nodes appended to one data file, then a manifest naming a root."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.nodes = bytearray()

    def add(self, body: bytes, *, compress: bool = False) -> tuple[int, int]:
        frame = _frame(BTREE_MAGIC, body, compress=compress)
        at = len(self.nodes)
        self.nodes += frame
        return at, len(frame)

    def commit(self, root: tuple[int, int], height: int, **kwargs: int) -> Path:
        (self.root / "d").mkdir(parents=True, exist_ok=True)
        (self.root / DATA).write_bytes(bytes(self.nodes))
        (self.root / "manifest.ocdbt").write_bytes(manifest(root, height, **kwargs))
        return self.root


def test_a_forged_database_in_the_published_format_is_read(tmp_path: Path) -> None:
    """The forger below writes what the reader understands: the hostile cases differ from this one only
    in the hostile part."""
    db = _Db(tmp_path)
    a = db.add(leaf({b"a/.zarray": b"{}", b"a/0": b"x"}))
    b = db.add(leaf({b"b/.zarray": b"[]"}), compress=True)
    top = db.add(interior(1, [(b"a", *a), (b"b", *b)]))
    index = OcdbtIndex(db.commit(top, 1))
    assert sorted(index.values) == ["a/.zarray", "a/0", "b/.zarray"]
    assert index.read("b/.zarray") == b"[]" and index.height == 1


def test_a_node_reached_twice_is_not_a_tree(tmp_path: Path) -> None:
    """Children that share a node (fan-out 200, height 4 would be 1.6e9 node reads) are refused at the
    second visit."""
    db = _Db(tmp_path)
    node = db.add(leaf({b"k": b"v"}))
    for height in range(1, 5):
        node = db.add(interior(height, [(bytes([i]), *node) for i in range(200)]))
    started = time.monotonic()
    with pytest.raises(OcdbtFormatError, match="reached twice"):
        OcdbtIndex(db.commit(node, 4))
    assert time.monotonic() - started < 5


def test_a_small_node_that_decodes_to_gigabytes_is_refused_within_bounded_memory(tmp_path: Path) -> None:
    db = _Db(tmp_path)
    bomb = leaf({b"k": bytes(256 << 20)})  # 256 MiB inline: compresses to a few KiB
    root = db.add(bomb, compress=True)
    assert root[1] < 1 << 20
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(OcdbtFormatError, match="decodes to more than"):
        OcdbtIndex(db.commit(root, 0))
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 128 << 10, f"the reader held {grown_kib} KiB for a refused node"


def test_the_database_s_own_node_size_bounds_a_node(tmp_path: Path) -> None:
    db = _Db(tmp_path)
    root = db.add(leaf({b"k": bytes(3 << 20)}), compress=True)
    with pytest.raises(OcdbtFormatError, match="decodes to more than"):
        OcdbtIndex(db.commit(root, 0, max_decoded=64 << 10))  # limit: 1 MiB (4 x 64 KiB, at least 1 MiB)
    assert OcdbtIndex(db.commit(root, 0, max_decoded=1 << 20)).read("k") == bytes(3 << 20)


@pytest.mark.parametrize(("offset", "length"), [(0, 1 << 40), (1 << 64, 100), (5, 1 << 63)])
def test_a_node_outside_its_file_is_a_format_error(tmp_path: Path, offset: int, length: int) -> None:
    db = _Db(tmp_path)
    db.add(leaf({b"k": b"v"}))
    with pytest.raises(OcdbtFormatError, match="outside its"):
        OcdbtIndex(db.commit((offset, length), 0))


def test_a_tree_taller_than_any_real_one_is_refused(tmp_path: Path) -> None:
    db = _Db(tmp_path)
    root = db.add(leaf({b"k": b"v"}))
    with pytest.raises(OcdbtFormatError, match="height 200"):
        OcdbtIndex(db.commit(root, 200))


def test_a_value_outside_its_file_is_a_format_error(tmp_path: Path) -> None:
    """An out-of-line value whose offset lies past its data file: the read refuses it."""
    db = _Db(tmp_path)
    body = (b"\x00" + _table([DATA]) + _varint(1) + _keys([b"k"]) + b"k" + _varint(1 << 30) + _varint(1)
            + _varint(0) + _varint(1 << 62))
    index = OcdbtIndex(db.commit(db.add(body), 0))
    with pytest.raises(OcdbtFormatError, match="outside its"):
        index.read("k")
