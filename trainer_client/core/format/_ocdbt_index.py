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
in the sidecar), and a few forged kilobytes once cost unbounded work: a tree whose nodes named one data
file by ever new paths (``./d/f``, ``.//d/f``, ...) looked new at every visit, so height 16 and fan-out 8 were
8^16 node reads from a 4 KB file. Now (docs/operations.md, "What each limit defends"):

* a data file path is plain — no empty, ``.`` or ``..`` segment, not absolute — and stays inside the
  database; a node is known by its file's identity (device, inode) and offset, and reaching one twice
  (by any path, through links or hard links too) is refused: a tree never shares a node;
* a read spends a ``Budget`` (``trainer_client/core/format/_ocdbt_nodes.py``): ``deadline_s`` (``DEADLINE_S``),
  at most ``MAX_NODES`` nodes, ``MAX_KEYS`` keys and ``MAX_INLINE_BYTES`` of values kept from the nodes;
* a node decodes to at most a few times the database's own ``max_decoded_node_bytes`` (never more than
  64 MiB), the manifest to at most ``MAX_MANIFEST_BYTES``, and a tree is at most 32 levels deep.

Passing any of these bounds is an ``OcdbtRefusedError`` (an ``OcdbtFormatError``): the database is hostile
or broken beyond what a real one can be, and callers do not hand it to tensorstore either.
"""

from __future__ import annotations

import dataclasses
import os
import stat
from collections.abc import Callable
from pathlib import Path

from trainer_client.core._errors import OcdbtFormatError, OcdbtRefusedError
from trainer_client.core.format._files import OCDBT_MANIFEST
from trainer_client.core.format._ocdbt_nodes import Budget, Cursor, decode_node

_MANIFEST_MAGIC = 0x0CDB3A2A
_VERSION_NODE_MAGIC = 0x0CDB1234
_BTREE_NODE_MAGIC = 0x0CDB20DE
_MAX_DECODED_NODE = 64 << 20  # what one node may decode to, whatever the database says
_MIN_DECODED_LIMIT = 1 << 20
_MAX_HEIGHT = 32
MAX_MANIFEST_BYTES = 1 << 20  # a manifest, stored or decoded (a real one is a few hundred bytes)
DEADLINE_S = 30.0  # a read of the index (500,000 keys: 3 to 6 s on a loaded 2-core VM)
MAX_NODES = 1 << 20  # B+tree nodes visited by one read
MAX_KEYS = 1 << 22  # keys of the latest version (about 1 GiB of memory at the bound)
MAX_INLINE_BYTES = 256 << 20  # values stored in the nodes themselves, kept in memory
MAX_VALUE_BYTES = 64 << 20  # one value read whole (``read``: zarr metadata, kilobytes)


@dataclasses.dataclass(frozen=True)
class ValueRef:
    """One value: ``inline`` bytes, or ``length`` bytes at ``offset`` of the data file ``path``."""

    path: Path | None
    offset: int
    length: int
    inline: bytes | None = None


def _plain(path: str, transitive: str, cur: Cursor) -> str:
    """``transitive + path`` when ``path`` is a plain relative path inside the database; else refused: a path
    that leaves it, and one with an empty or ``.`` segment (another name for a file the tree already names).
    An empty ``path`` (tensorstore lists one in its tables) names no file: reading it is refused."""
    if not path:
        return transitive
    path = transitive + path
    segments = path.split("/")
    if path.startswith("/") or ".." in segments:
        raise OcdbtRefusedError(f"{cur.what}: data file path {path!r} leaves the database")
    if "" in segments or "." in segments:
        raise OcdbtRefusedError(f"{cur.what}: data file path {path!r} is not a plain path (an empty or '.' "
                                f"segment names a file another way)")
    return path


def _data_file_table(cur: Cursor, transitive: str) -> list[tuple[str, str]]:
    """``(full path, transitive path for the nodes it holds)`` per data file of a table."""
    n = cur.count(cur.varint(), 2)  # each: a suffix length and a base length at least
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
        out.append((_plain(text, transitive, cur), transitive + text[: base[i]]))
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
    """The latest version's keys of the OCDBT database rooted at ``root`` (a local directory), read within
    ``deadline_s`` seconds (None: no deadline) from at most ``max_nodes`` nodes holding at most ``max_keys``
    keys; ``OcdbtRefusedError`` past any of them. ``clock``: what the deadline is read from (the monotonic clock
    unless given)."""

    def __init__(self, root: str | Path, *, deadline_s: float | None = DEADLINE_S, max_nodes: int = MAX_NODES,
                 max_keys: int = MAX_KEYS, clock: Callable[[], float] | None = None) -> None:
        self.root = Path(root)
        self._resolved_root = self.root.resolve()
        self.values: dict[str, ValueRef] = {}
        self._node_limit = _MAX_DECODED_NODE
        self._budget = Budget(deadline_s, max_nodes, max_keys, MAX_INLINE_BYTES, clock)
        self._visited: set[tuple[int, int, int]] = set()  # (device, inode, offset) of every node read
        self._inside: set[str] = set()  # data file paths found inside the database
        top = self._manifest_root()
        self.height = top.height if top is not None else 0  # of the B+tree's root: 0 when it is one leaf
        if top is not None:
            self._walk(top)

    def _read(self, rel: str, offset: int | None = None, length: int | None = None, *, node: str = "") -> bytes:
        """``length`` bytes at ``offset`` of the regular file ``rel`` inside the database (the whole manifest
        when ``offset`` is None). ``node``: what the bytes are, when they are a B+tree node, which is refused
        if this file (by any path to it) was read at this offset before."""
        path = self.root / rel
        if rel not in self._inside:  # resolved once per path (a few lstat calls: most of a small node's cost)
            if not path.resolve().is_relative_to(self._resolved_root):
                raise OcdbtRefusedError(f"data file {rel!r} lies outside the database")
            self._inside.add(rel)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO planted as a data file does not block
        except OSError as exc:
            raise OcdbtFormatError(f"{rel}: {exc}") from exc
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise OcdbtRefusedError(f"{rel} is not a regular file")
            size = info.st_size
            if offset is None:
                if size > MAX_MANIFEST_BYTES:
                    raise OcdbtRefusedError(f"{rel}: {size} bytes is not a manifest (at most {MAX_MANIFEST_BYTES})")
                offset, length = 0, size
            want = length if length is not None else size - offset
            if not 0 <= offset <= size or not 0 <= want <= size - offset:
                raise OcdbtFormatError(f"{rel}: {want} bytes at {offset} lie outside its {size} bytes")
            if node:
                if (identity := (info.st_dev, info.st_ino, offset)) in self._visited:
                    raise OcdbtRefusedError(f"{node} is reached twice (two parents, or two names of one file): "
                                            f"not a tree")
                self._visited.add(identity)
                if want > 2 * self._node_limit:
                    raise OcdbtRefusedError(f"{node}: {want} bytes, more than a node of this database may have")
            out = os.pread(fd, want, offset)
        except OSError as exc:
            raise OcdbtFormatError(f"{rel}: {exc}") from exc
        finally:
            os.close(fd)
        if len(out) != want:
            raise OcdbtFormatError(f"{rel}: {want} bytes at {offset} wanted, {len(out)} there")
        return out

    def _manifest_root(self) -> _NodeRef | None:
        cur = decode_node(self._read(OCDBT_MANIFEST), _MANIFEST_MAGIC, OCDBT_MANIFEST, MAX_MANIFEST_BYTES,
                          self._budget)
        cur.take(16)  # uuid
        if (kind := cur.varint()) != 0:
            raise OcdbtFormatError(f"manifest kind {kind} (numbered manifests are not read here)")
        max_inline = cur.varint()
        # nodes are written to about this size (a leaf holds at least one inline value whole); allow slack,
        # never past the hard limit
        self._node_limit = min(_MAX_DECODED_NODE, max(_MIN_DECODED_LIMIT, 4 * cur.varint(), 4 * max_inline))
        cur.byte()  # version_tree_arity_log2
        if (method := cur.varint()) == 1:
            cur.take(4)  # zstd level
        elif method != 0:
            raise OcdbtFormatError(f"unknown compression method {method} in the manifest")
        table = _data_file_table(cur, "")
        n = cur.count(cur.varint(), 14)  # each: 5 numbers, a height, 3 statistics, a commit time of 8 bytes
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
        self._budget.node(what)
        raw = self._read(full, node.offset, node.length, node=what)
        cur = decode_node(raw, _BTREE_NODE_MAGIC, what, self._node_limit, self._budget)
        height = cur.byte()
        if height != node.height:
            raise cur.fail(f"height {height}, its parent says {node.height}")
        # a node's data file table applies below it: paths in it are relative to the node's transitive path
        table = _data_file_table(cur, transitive)
        n = cur.count(cur.varint(), 2)  # each: a key suffix length and a value length (or a child's) at least
        if height == 0:
            self._budget.keys(n, 0, what)  # refused before a leaf of too many keys is decoded
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
    def _keys(cur: Cursor, n: int, *, with_subtree_prefix: bool) -> list[tuple[bytes, int]]:
        """The node's relative keys (and, in interior nodes, the length of each child's common prefix)."""
        prefix = cur.varints(max(n - 1, 0))
        suffix = cur.varints(n)
        common = cur.varints(n) if with_subtree_prefix else [0] * n
        keys: list[tuple[bytes, int]] = []
        previous = b""
        for i in range(n):
            if not i % 4096:
                cur.budget.check(cur.what)
            key = previous[: prefix[i - 1]] + cur.take(suffix[i]) if i else cur.take(suffix[0])
            keys.append((key, common[i]))
            previous = key
        return keys

    def _leaf(self, cur: Cursor, prefix: bytes, keys: list[tuple[bytes, int]], table: list[tuple[str, str]]) -> None:
        n = len(keys)
        lengths = cur.varints(n)
        kinds = cur.varints(n)
        if any(k not in (0, 1) for k in kinds):
            raise cur.fail("unknown value kind")
        indirect = [i for i in range(n) if kinds[i] == 1]
        ids, offsets = cur.varints(len(indirect)), cur.varints(len(indirect))
        refs: dict[int, ValueRef] = {}
        files = [self.root / full for full, _ in table]  # one Path per data file, not per value
        for i, fid, off in zip(indirect, ids, offsets, strict=True):
            if fid >= len(table):
                raise cur.fail("value in a data file the table does not list")
            refs[i] = ValueRef(files[fid], off, lengths[i])
        inline = [i for i in range(n) if kinds[i] == 0]
        self._budget.keys(0, sum(lengths[i] for i in inline), cur.what)
        for i in inline:
            refs[i] = ValueRef(None, 0, lengths[i], cur.take(lengths[i]))
        cur.done()
        for i, (key, _) in enumerate(keys):
            self.values[(prefix + key).decode("utf-8", "surrogateescape")] = refs[i]

    def read(self, key: str, max_bytes: int = MAX_VALUE_BYTES) -> bytes:
        """The whole value of ``key``, for small values such as ``.zarray``: one longer than ``max_bytes`` is
        refused unread."""
        ref = self.values[key]
        if ref.inline is not None:
            return ref.inline
        assert ref.path is not None
        if ref.length > max_bytes:
            raise OcdbtRefusedError(f"{key}: {ref.length} bytes, more than the {max_bytes} read whole")
        return self._read(str(ref.path.relative_to(self.root)), ref.offset, ref.length)


__all__ = ["DEADLINE_S", "MAX_KEYS", "MAX_NODES", "OcdbtFormatError", "OcdbtIndex", "OcdbtRefusedError", "ValueRef"]
