"""OCDBT databases written byte by byte in tensorstore's published format (``kvstore/ocdbt/index.rst``, version 0),
as a forger would write them: the well-formed ones the index reader must read, and the hostile ones it must
refuse in bounded time and memory (``trainer_client/core/format/_ocdbt_index.py``). Also a whole forged step:
the files plain Orbax leaves (``_CHECKPOINT_METADATA``, the marker, ``default/_METADATA``) around such a
database, so a sidecar adopts it and reads its index."""

from __future__ import annotations

import json
from pathlib import Path

import google_crc32c
import zstandard

MANIFEST_MAGIC, BTREE_MAGIC = 0x0CDB3A2A, 0x0CDB20DE
DATA = "d/nodes"


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def varints(values: list[int]) -> bytes:
    return b"".join(varint(v) for v in values)


def frame(magic: int, body: bytes, *, compress: bool = False, content_size: bool = True) -> bytes:
    """A node as stored: magic, length, format version 0, compression, body, CRC-32C. ``content_size``: whether
    a compressed frame states its decoded size (tensorstore's always do)."""
    payload = zstandard.ZstdCompressor(write_content_size=content_size).compress(body) if compress else body
    head = varint(0) + varint(1 if compress else 0)
    length = 4 + 8 + len(head) + len(payload) + 4
    raw = magic.to_bytes(4, "big") + length.to_bytes(8, "little") + head + payload
    return raw + google_crc32c.value(raw).to_bytes(4, "little")


def table(paths: list[str], bases: list[int] | None = None) -> bytes:
    """A data file table of ``paths`` (each with its base path length: 0 unless given)."""
    encoded = [p.encode() for p in paths]
    return (varint(len(encoded)) + varints([0] * max(len(encoded) - 1, 0)) + varints([len(p) for p in encoded])
            + varints(bases or [0] * len(encoded)) + b"".join(encoded))


def _keys(keys: list[bytes]) -> bytes:
    return varints([0] * max(len(keys) - 1, 0)) + varints([len(k) for k in keys])


def leaf(items: dict[bytes, bytes]) -> bytes:
    """A leaf node holding ``items`` inline."""
    keys = sorted(items)
    return (b"\x00" + table([]) + varint(len(keys)) + _keys(keys) + b"".join(keys)
            + varints([len(items[k]) for k in keys]) + varints([0] * len(keys)) + b"".join(items[k] for k in keys))


def interior(height: int, children: list[tuple[bytes, int, int]], *, files: list[str] | None = None,
             bases: list[int] | None = None, file_ids: list[int] | None = None) -> bytes:
    """An interior node: ``(first key, offset, length)`` per child, in data file ``file_ids[i]`` of ``files``
    (default: all in ``DATA``)."""
    keys = [c[0] for c in children]
    n = len(children)
    return (bytes([height]) + table(files or [DATA], bases) + varint(n) + _keys(keys) + varints([0] * n)
            + b"".join(keys) + varints(file_ids or [0] * n) + varints([c[1] for c in children])
            + varints([c[2] for c in children]) + varints([0] * 3 * n))


def manifest_body(root: tuple[int, int], height: int, *, max_decoded: int = 8 << 20) -> bytes:
    """A manifest's body whose one version's root node is ``(offset, length)`` in ``DATA``."""
    return (bytes(16) + varint(0) + varint(100) + varint(max_decoded) + b"\x04" + varint(0) + table([DATA])
            + varint(1) + varint(1) + bytes([height]) + varint(0) + varint(root[0]) + varint(root[1])
            + varints([0, 0, 0]) + (0).to_bytes(8, "little"))


class Db:
    """A database under construction: nodes appended to one data file, then a manifest naming a root."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.nodes = bytearray()

    def add(self, body: bytes, *, compress: bool = False, content_size: bool = True) -> tuple[int, int]:
        raw = frame(BTREE_MAGIC, body, compress=compress, content_size=content_size)
        at = len(self.nodes)
        self.nodes += raw
        return at, len(raw)

    def commit(self, root: tuple[int, int], height: int, **kwargs: int) -> Path:
        (self.root / "d").mkdir(parents=True, exist_ok=True)
        (self.root / DATA).write_bytes(bytes(self.nodes))
        (self.root / "manifest.ocdbt").write_bytes(frame(MANIFEST_MAGIC, manifest_body(root, height, **kwargs)))
        return self.root


def aliased_tree(root: Path, *, height: int = 16, fanout: int = 8) -> Path:
    """The attack: one node per level, each naming the node below ``fanout`` times through ``fanout`` spellings
    of the one data file (``./d/nodes``, ``.//d/nodes``, ...) whose base paths make every path down the tree a
    new string. A 3.8 KB data file and a 71-byte manifest; a reader keyed on path strings visits
    ``fanout ** height`` nodes."""
    db = Db(root)
    node = db.add(leaf({b"k": b"v"}))
    aliases = ["." + "/" * (i + 1) + DATA for i in range(fanout)]
    for h in range(1, height + 1):
        node = db.add(interior(h, [(bytes([i]), *node) for i in range(fanout)], files=aliases,
                               bases=[len(a) - len(DATA) for a in aliases], file_ids=list(range(fanout))))
    return db.commit(node, height)


def wide_tree(root: Path, *, leaves: int, fanout: int = 1000) -> Path:
    """A real tree of ``leaves`` distinct one-key leaves under interior nodes of ``fanout`` children (height 2):
    read once each, it is slow (a node is a file open and a read: ~30 µs) in little memory and disk (~25 bytes
    a leaf)."""
    db = Db(root)
    one = frame(BTREE_MAGIC, leaf({b"k": b""}))  # every leaf the same bytes at its own offset
    db.nodes += one * leaves
    level = [(i * len(one), len(one)) for i in range(leaves)]
    height = 0
    while len(level) > 1 or height == 0:
        height += 1
        level = [db.add(interior(height, [(b"", *node) for node in level[i:i + fanout]]))
                 for i in range(0, len(level), fanout)]
    return db.commit(level[0], height)


def forged_step(step_dir: Path) -> Path:
    """The files plain Orbax leaves in a committed step (no ckptd manifest: a sidecar adopts it), its item
    ``default`` empty; returns the item directory, where the caller writes the database."""
    item = step_dir / "default"
    item.mkdir(parents=True)
    (step_dir / "_CHECKPOINT_METADATA").write_text("{}")
    (item / "_METADATA").write_text(json.dumps({"tree_metadata": {}}))
    (step_dir / "commit_success.txt").write_text("ok")
    return item


def healthy_step(step_dir: Path) -> Path:
    """A committed step whose database holds one array's zarr metadata (``w``: float32[4])."""
    db = Db(forged_step(step_dir))
    return db.commit(db.add(leaf({b"w/.zarray": json.dumps({"shape": [4], "dtype": "<f4"}).encode()})), 0)


__all__ = ["BTREE_MAGIC", "DATA", "MANIFEST_MAGIC", "Db", "aliased_tree", "forged_step", "frame", "healthy_step",
           "interior", "leaf", "manifest_body", "table", "varint", "varints", "wide_tree"]
