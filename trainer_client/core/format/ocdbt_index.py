"""Where each value of an OCDBT database lies: a reader of tensorstore's OCDBT index on a local disk.

Orbax writes every array of a checkpoint into one OCDBT key-value database (tensorstore's
Optionally-Cooperative Distributed B+Tree): a manifest, B+tree nodes, and data files holding the values
(zarr chunks) back to back. Reading a value through tensorstore costs more than reading its bytes: a
2 GiB step takes ~2.4 s warm or cold where the disk reads its files in ~2.1 s, and that was the whole gap
between a ckptd restore and the disk (docs/benchmarks.md). This module reads only the index — the
manifest, the latest version's B+tree — and answers, per key, the file, offset and length of its value
(or the value itself, when it is stored inline), so a restore can read the chunks itself, in parallel,
straight into the buffers the devices take.

It follows the published storage format (tensorstore ``kvstore/ocdbt/index.rst``, format version 0):
every node's header, length and CRC-32C are checked, and anything this reader does not know (another
format version, a numbered manifest, an unknown compression) raises ``OcdbtFormatError``, on which the
caller falls back to tensorstore. It never writes.

The bytes it reads come from storage and are not trusted (a direct restore in the trainer, the zarr index
in the sidecar): every read stays inside its file, a node decodes to at most a few times the database's
own ``max_decoded_node_bytes`` (never more than 64 MiB: a small compressed node cannot claim gigabytes),
a tree is at most 32 levels deep and never reaches one node twice (a tree that shared its nodes could
make a few kilobytes cost billions of reads). Each of these, like any malformed input, is an
``OcdbtFormatError``.
"""

from __future__ import annotations

import dataclasses
import os
import struct
from pathlib import Path

import google_crc32c

from trainer_client.core.errors import OcdbtFormatError
from trainer_client.core.format.files import OCDBT_MANIFEST

_MANIFEST_MAGIC = 0x0CDB3A2A
_VERSION_NODE_MAGIC = 0x0CDB1234
_BTREE_NODE_MAGIC = 0x0CDB20DE
_HEADER = struct.Struct("<Q")  # the length that follows the big-endian magic
_MAX_DECODED_NODE = 64 << 20  # what one node may decode to, whatever the database says
_MIN_DECODED_LIMIT = 1 << 20
_MAX_MANIFEST_BYTES = 64 << 20
_MAX_HEIGHT = 32


@dataclasses.dataclass(frozen=True)
class ValueRef:
    """One value: ``inline`` bytes, or ``length`` bytes at ``offset`` of the data file ``path``."""

    path: Path | None
    offset: int
    length: int
    inline: bytes | None = None


class _Cursor:
    """Sequential decoding of one node's body."""

    def __init__(self, data: bytes, what: str) -> None:
        self.data = data
        self.pos = 0
        self.what = what

    def fail(self, problem: str) -> OcdbtFormatError:
        return OcdbtFormatError(f"{self.what}: {problem} at byte {self.pos}")

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise self.fail(f"truncated (wanted {n} bytes)")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def byte(self) -> int:
        return self.take(1)[0]

    def varint(self) -> int:
        value = shift = 0
        while True:
            b = self.byte()
            value |= (b & 0x7F) << shift
            if not b & 0x80:
                return value
            shift += 7
            if shift > 63:
                raise self.fail("varint longer than 64 bits")

    def varints(self, n: int) -> list[int]:
        return [self.varint() for _ in range(n)]

    def uint64le(self) -> int:
        return int.from_bytes(self.take(8), "little")

    def done(self) -> None:
        if self.pos != len(self.data):
            raise self.fail(f"{len(self.data) - self.pos} bytes left over")


def _decompress(body: bytes, limit: int, what: str) -> bytes:
    """A zstd frame's content, refused once it passes ``limit`` bytes (its header's size is not trusted)."""
    import zstandard

    out = bytearray()
    try:
        with zstandard.ZstdDecompressor().stream_reader(body) as reader:
            while chunk := reader.read(min(1 << 20, limit + 1 - len(out))):
                out += chunk
                if len(out) > limit:
                    raise OcdbtFormatError(f"{what}: decodes to more than {limit} bytes")
    except zstandard.ZstdError as exc:
        raise OcdbtFormatError(f"{what}: zstd: {exc}") from exc
    return bytes(out)


def _decode_node(raw: bytes, magic: int, what: str, limit: int = _MAX_DECODED_NODE) -> _Cursor:
    """Check a node's outer header and CRC-32C, and return a cursor over its (decompressed) body of at most
    ``limit`` bytes."""
    if len(raw) < 4 + 8 + 2 + 4:
        raise OcdbtFormatError(f"{what}: {len(raw)} bytes is too short")
    found = int.from_bytes(raw[:4], "big")
    if found != magic:
        raise OcdbtFormatError(f"{what}: magic {found:#x}, expected {magic:#x}")
    (length,) = _HEADER.unpack_from(raw, 4)
    if length != len(raw):
        raise OcdbtFormatError(f"{what}: header says {length} bytes, read {len(raw)}")
    if google_crc32c.value(raw[:-4]) != int.from_bytes(raw[-4:], "little"):
        raise OcdbtFormatError(f"{what}: CRC-32C mismatch")
    head = _Cursor(raw[:-4], what)
    head.pos = 12
    version = head.varint()
    if version != 0:
        raise OcdbtFormatError(f"{what}: format version {version} (this reader knows 0)")
    compression = head.varint()
    body = raw[head.pos : -4]
    if compression == 1:
        body = _decompress(body, limit, what)
    elif compression != 0:
        raise OcdbtFormatError(f"{what}: unknown compression {compression}")
    return _Cursor(body, what)


def _data_file_table(cur: _Cursor, transitive: str) -> list[tuple[str, str]]:
    """``(full path, transitive path for the nodes it holds)`` per data file of a table."""
    n = cur.varint()
    prefix = cur.varints(max(n - 1, 0))
    suffix = cur.varints(n)
    base = cur.varints(n)
    out: list[tuple[str, str]] = []
    previous = b""
    for i in range(n):
        path = previous[: prefix[i - 1]] + cur.take(suffix[i]) if i else cur.take(suffix[0])
        if base[i] > len(path):
            raise cur.fail("base path longer than the path")
        text = path.decode("utf-8", "surrogateescape")
        if text.startswith("/") or ".." in text.split("/"):
            raise cur.fail(f"data file path {text!r} leaves the database")
        out.append((transitive + text, transitive + text[: base[i]]))
        previous = path
    return out


@dataclasses.dataclass(frozen=True)
class _NodeRef:
    file: tuple[str, str]  # (full path, transitive path) from a data file table
    offset: int
    length: int
    height: int
    prefix: bytes  # the key prefix of every key under this node


class OcdbtIndex:
    """The latest version's keys of the OCDBT database rooted at ``root`` (a local directory)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self._resolved_root = self.root.resolve()
        self.values: dict[str, ValueRef] = {}
        self._node_limit = _MAX_DECODED_NODE
        self._visited: set[tuple[str, int]] = set()
        top = self._manifest_root()
        self.height = top.height if top is not None else 0  # of the B+tree's root: 0 when it is one leaf
        if top is not None:
            self._walk(top)

    def _read(self, rel: str, offset: int | None = None, length: int | None = None) -> bytes:
        path = self.root / rel
        if not path.resolve().is_relative_to(self._resolved_root):
            raise OcdbtFormatError(f"data file {rel!r} lies outside the database")
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if offset is None:
                    if size > _MAX_MANIFEST_BYTES:
                        raise OcdbtFormatError(f"{rel}: {size} bytes is not a manifest")
                    return f.read()
                want = length if length is not None else size - offset
                if not 0 <= offset <= size or not 0 <= want <= size - offset:
                    raise OcdbtFormatError(f"{rel}: {want} bytes at {offset} lie outside its {size} bytes")
                out = os.pread(f.fileno(), want, offset)
        except OSError as exc:
            raise OcdbtFormatError(f"{rel}: {exc}") from exc
        if len(out) != want:
            raise OcdbtFormatError(f"{rel}: {want} bytes at {offset} wanted, {len(out)} there")
        return out

    def _manifest_root(self) -> _NodeRef | None:
        cur = _decode_node(self._read(OCDBT_MANIFEST), _MANIFEST_MAGIC, OCDBT_MANIFEST)
        cur.take(16)  # uuid
        if (kind := cur.varint()) != 0:
            raise OcdbtFormatError(f"manifest kind {kind} (numbered manifests are not read here)")
        cur.varint()  # max_inline_value_bytes
        # nodes are written to about this size; allow slack, never past the hard limit
        self._node_limit = min(_MAX_DECODED_NODE, max(_MIN_DECODED_LIMIT, 4 * cur.varint()))
        cur.byte()  # version_tree_arity_log2
        if (method := cur.varint()) == 1:
            cur.take(4)  # zstd level
        elif method != 0:
            raise OcdbtFormatError(f"unknown compression method {method} in the manifest")
        table = _data_file_table(cur, "")
        n = cur.varint()
        generation = cur.varints(n)
        heights = [cur.byte() for _ in range(n)]
        file_ids = cur.varints(n)
        offsets = cur.varints(n)
        lengths = cur.varints(n)
        cur.varints(3 * n)  # num_keys, num_tree_bytes, num_indirect_value_bytes
        for _ in range(n):
            cur.uint64le()  # commit_time
        if n == 0:
            return None  # an empty database (older versions live in version nodes only when newer exist)
        latest = max(range(n), key=lambda i: generation[i])
        if lengths[latest] == 0:
            return None  # the latest version has no root node: no keys
        if file_ids[latest] >= len(table):
            raise cur.fail("root node in a data file the table does not list")
        if heights[latest] > _MAX_HEIGHT:
            raise cur.fail(f"a tree of height {heights[latest]}")
        return _NodeRef(table[file_ids[latest]], offsets[latest], lengths[latest], heights[latest], b"")

    def _walk(self, node: _NodeRef) -> None:
        full, transitive = node.file
        what = f"B+tree node {full}@{node.offset}"
        if (full, node.offset) in self._visited:
            raise OcdbtFormatError(f"{what} is reached twice: not a tree")
        self._visited.add((full, node.offset))
        cur = _decode_node(self._read(full, node.offset, node.length), _BTREE_NODE_MAGIC, what, self._node_limit)
        height = cur.byte()
        if height != node.height:
            raise cur.fail(f"height {height}, its parent says {node.height}")
        # a node's data file table applies below it: paths in it are relative to the node's transitive path
        table = _data_file_table(cur, transitive)
        n = cur.varint()
        keys = self._keys(cur, n, with_subtree_prefix=height > 0)
        if height == 0:
            self._leaf(cur, node.prefix, keys, table)
            return
        ids, offsets, lengths = cur.varints(n), cur.varints(n), cur.varints(n)
        cur.varints(3 * n)  # statistics
        cur.done()
        for (key, common), fid, off, length in zip(keys, ids, offsets, lengths, strict=True):
            if fid >= len(table):
                raise cur.fail("child node in a data file the table does not list")
            self._walk(_NodeRef(table[fid], off, length, height - 1, node.prefix + key[:common]))

    @staticmethod
    def _keys(cur: _Cursor, n: int, *, with_subtree_prefix: bool) -> list[tuple[bytes, int]]:
        """The node's relative keys (and, in interior nodes, the length of each child's common prefix)."""
        prefix = cur.varints(max(n - 1, 0))
        suffix = cur.varints(n)
        common = cur.varints(n) if with_subtree_prefix else [0] * n
        keys: list[tuple[bytes, int]] = []
        previous = b""
        for i in range(n):
            key = previous[: prefix[i - 1]] + cur.take(suffix[i]) if i else cur.take(suffix[0])
            keys.append((key, common[i]))
            previous = key
        return keys

    def _leaf(self, cur: _Cursor, prefix: bytes, keys: list[tuple[bytes, int]], table: list[tuple[str, str]]) -> None:
        n = len(keys)
        lengths = cur.varints(n)
        kinds = cur.varints(n)
        if any(k not in (0, 1) for k in kinds):
            raise cur.fail("unknown value kind")
        indirect = [i for i in range(n) if kinds[i] == 1]
        ids, offsets = cur.varints(len(indirect)), cur.varints(len(indirect))
        refs: dict[int, ValueRef] = {}
        for i, fid, off in zip(indirect, ids, offsets, strict=True):
            if fid >= len(table):
                raise cur.fail("value in a data file the table does not list")
            refs[i] = ValueRef(self.root / table[fid][0], off, lengths[i])
        for i in range(n):
            if kinds[i] == 0:
                refs[i] = ValueRef(None, 0, lengths[i], cur.take(lengths[i]))
        cur.done()
        for i, (key, _) in enumerate(keys):
            self.values[(prefix + key).decode("utf-8", "surrogateescape")] = refs[i]

    def read(self, key: str) -> bytes:
        """The whole value of ``key`` (for small values such as ``.zarray``)."""
        ref = self.values[key]
        if ref.inline is not None:
            return ref.inline
        assert ref.path is not None
        return self._read(str(ref.path.relative_to(self.root)), ref.offset, ref.length)


__all__ = [ "OcdbtFormatError", "OcdbtIndex", "ValueRef"]
