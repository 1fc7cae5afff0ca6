"""The OCDBT index reader against hostile databases: it reads bytes from storage that nobody vouches for
(the trainer's direct restore, the sidecar's zarr index), so every malformed input is its own
``OcdbtFormatError``, in bounded time and memory; one past a bound no real database reaches (aliased files,
shared nodes, the node, key and time budget, decoded sizes) is an ``OcdbtRefusedError``, which the sidecar
does not hand to tensorstore either.

The databases here are written byte by byte in tensorstore's published format
(``tests/support/forged_ocdbt.py``), which is how a forged one would be made;
tests/trainer/runtime/test_direct_restore.py checks the reader against tensorstore's own.
"""

from __future__ import annotations

import os
import re
import resource
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.forged_ocdbt import (
    DATA,
    MANIFEST_MAGIC,
    Db,
    aliased_tree,
    forged_step,
    frame,
    interior,
    leaf,
    table,
    varint,
)
from tests.support.helpers import SteppingClock
from trainer_client.core._errors import ArrayIndexError, OcdbtFormatError, OcdbtRefusedError
from trainer_client.core.format._array_index import read_array_index
from trainer_client.core.format._ocdbt_index import OcdbtIndex


def test_a_forged_database_in_the_published_format_is_read(tmp_path: Path) -> None:
    """The forger below writes what the reader understands: the hostile cases differ from this one only
    in the hostile part."""
    db = Db(tmp_path)
    a = db.add(leaf({b"a/.zarray": b"{}", b"a/0": b"x"}))
    b = db.add(leaf({b"b/.zarray": b"[]"}), compress=True)
    top = db.add(interior(1, [(b"a", *a), (b"b", *b)]))
    index = OcdbtIndex(db.commit(top, 1))
    assert sorted(index.values) == ["a/.zarray", "a/0", "b/.zarray"]
    assert index.read("b/.zarray") == b"[]" and index.height == 1


def test_a_node_reached_twice_is_not_a_tree(tmp_path: Path) -> None:
    """Children that share a node (fan-out 200, height 4 would be 1.6e9 node reads) are refused at the
    second visit."""
    db = Db(tmp_path)
    node = db.add(leaf({b"k": b"v"}))
    for height in range(1, 5):
        node = db.add(interior(height, [(bytes([i]), *node) for i in range(200)]))
    started = time.monotonic()
    with pytest.raises(OcdbtFormatError, match="reached twice"):
        OcdbtIndex(db.commit(node, 4))
    assert time.monotonic() - started < 5


def test_a_small_node_that_decodes_to_gigabytes_is_refused_within_bounded_memory(tmp_path: Path) -> None:
    db = Db(tmp_path)
    bomb = leaf({b"k": bytes(256 << 20)})  # 256 MiB inline: compresses to a few KiB
    root = db.add(bomb, compress=True)
    assert root[1] < 1 << 20
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(OcdbtFormatError, match=r"decodes to .*more than"):
        OcdbtIndex(db.commit(root, 0))
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 128 << 10, f"the reader held {grown_kib} KiB for a refused node"


def test_the_database_s_own_node_size_bounds_a_node(tmp_path: Path) -> None:
    db = Db(tmp_path)
    root = db.add(leaf({b"k": bytes(3 << 20)}), compress=True)
    with pytest.raises(OcdbtFormatError, match=r"decodes to .*more than"):
        OcdbtIndex(db.commit(root, 0, max_decoded=64 << 10))  # limit: 1 MiB (4 x 64 KiB, at least 1 MiB)
    assert OcdbtIndex(db.commit(root, 0, max_decoded=1 << 20)).read("k") == bytes(3 << 20)


@pytest.mark.parametrize(("offset", "length"), [(0, 1 << 40), (1 << 64, 100), (5, 1 << 63)])
def test_a_node_outside_its_file_is_a_format_error(tmp_path: Path, offset: int, length: int) -> None:
    db = Db(tmp_path)
    db.add(leaf({b"k": b"v"}))
    with pytest.raises(OcdbtFormatError, match="outside its"):
        OcdbtIndex(db.commit((offset, length), 0))


def test_a_tree_taller_than_any_real_one_is_refused(tmp_path: Path) -> None:
    db = Db(tmp_path)
    root = db.add(leaf({b"k": b"v"}))
    with pytest.raises(OcdbtFormatError, match="height 200"):
        OcdbtIndex(db.commit(root, 200))


def test_a_value_outside_its_file_is_a_format_error(tmp_path: Path) -> None:
    """An out-of-line value whose offset lies past its data file: the read refuses it."""
    db = Db(tmp_path)
    body = (b"\x00" + table([DATA]) + varint(1) + varint(1) + b"k" + varint(100) + varint(1)
            + varint(0) + varint(1 << 62))
    index = OcdbtIndex(db.commit(db.add(body), 0))
    with pytest.raises(OcdbtFormatError, match="outside its"):
        index.read("k")


def _refused_quickly(root: Path, match: str, within_s: float = 2.0, **bounds: Any) -> None:
    """``OcdbtIndex(root)`` raises ``OcdbtRefusedError`` matching ``match`` within ``within_s`` seconds, on a thread
    (the reader before these bounds never returned: the test must not hang with it)."""
    outcome: list[BaseException | None] = []

    def read() -> None:
        try:
            OcdbtIndex(root, **bounds)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    started = time.monotonic()
    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    thread.join(within_s + 5)
    took = time.monotonic() - started
    assert outcome, f"the reader did not return within {within_s + 5} s"
    assert isinstance(outcome[0], OcdbtRefusedError), outcome[0]
    assert re.search(match, str(outcome[0])), str(outcome[0])
    assert took < within_s, f"refused after {took:.2f} s"


def test_aliases_of_one_data_file_are_refused_at_once(tmp_path: Path) -> None:
    """The attack of a 3.8 KB data file and a 71-byte manifest: height 16, fan-out 8, every child named through
    another spelling of ``d/nodes``. Keyed on path strings the reader visited 8^16 nodes (it never returned
    and grew by ~150 MiB a minute); the first spelling with a ``.`` segment is refused."""
    root = aliased_tree(tmp_path)
    assert (root / DATA).stat().st_size < 4096 and (root / "manifest.ocdbt").stat().st_size < 100
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    _refused_quickly(root, r"'\./d/nodes' is not a plain path", within_s=0.5)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 16 << 10  # KiB


def test_one_file_under_many_plain_names_is_one_file(tmp_path: Path) -> None:
    """The same attack with plain names: eight links to the database's own directory (``a0`` ... ``a7`` -> ``.``),
    so every path down the tree is a new, plain string for the same file. A node is known by its file's
    device and inode: the second visit is refused."""
    for i in range(8):
        (tmp_path / f"a{i}").symlink_to(".")
    db = Db(tmp_path)
    node = db.add(leaf({b"k": b"v"}))
    names = [f"a{i}/{DATA}" for i in range(8)]
    for h in range(1, 17):
        node = db.add(interior(h, [(bytes([i]), *node) for i in range(8)], files=names,
                               bases=[3] * 8, file_ids=list(range(8))))
    _refused_quickly(db.commit(node, 16), "reached twice", within_s=0.5)
    (tmp_path / "e").mkdir()  # a hard link is another name too
    os.link(tmp_path / DATA, tmp_path / "e" / "nodes")
    db = Db(tmp_path)
    node = db.add(leaf({b"k": b"v"}))
    top = db.add(interior(1, [(b"a", *node), (b"b", *node)], files=[DATA, "e/nodes"], file_ids=[0, 1]))
    _refused_quickly(db.commit(top, 1), "reached twice", within_s=0.5)


def test_the_node_budget_and_the_deadline_bound_a_tree_of_distinct_nodes(tmp_path: Path) -> None:
    """A tree whose nodes are all distinct is read once each: the node budget and the deadline bound it."""
    db = Db(tmp_path)
    leaves = [db.add(leaf({bytes([i]): b"v"})) for i in range(50)]
    root = db.commit(db.add(interior(1, [(bytes([i]), *node) for i, node in enumerate(leaves)])), 1)
    assert len(OcdbtIndex(root).values) == 50
    _refused_quickly(root, "more than 20 B\\+tree nodes", max_nodes=20)
    _refused_quickly(root, "more than 40 keys", max_keys=40)
    # one leaf of 400,000 keys (what a forged manifest's node size allows) against a short deadline: a clock
    # stepped at each look passes it after a few looks, however fast the machine decodes (a fast one could
    # read the whole leaf within a real 0.05 s)
    big = Db(tmp_path / "big")
    top = big.add(leaf({i.to_bytes(3, "big"): b"" for i in range(400_000)}), compress=True)
    clock = SteppingClock(0.02)
    _refused_quickly(big.commit(top, 0, max_decoded=16 << 20), "not read within its deadline of 0.05 s",
                     deadline_s=0.05, clock=clock)
    assert clock.reads == 4  # the deadline set, then looks (every 4096 numbers decoded): the third is past it


def test_decompression_is_bounded_before_it_starts(tmp_path: Path) -> None:
    """A 2 KB zstd manifest that decodes to 63 MB of data file entries cost 46 s of CPU and 2 GiB per parse; a
    frame stating its size is refused before decoding, one stating none is decoded to 1 MiB at most."""
    body = (bytes(16) + varint(0) + varint(100) + varint(8 << 20) + b"\x04" + varint(0) + varint(21_000_000)
            + bytes(63_000_000))
    raw = frame(MANIFEST_MAGIC, body, compress=True)
    assert len(raw) < 4096
    (tmp_path / "manifest.ocdbt").write_bytes(raw)
    _refused_quickly(tmp_path, "decodes to 63000028 bytes, more than 1048576", within_s=0.5)
    (tmp_path / "manifest.ocdbt").write_bytes(frame(MANIFEST_MAGIC, body, compress=True, content_size=False))
    _refused_quickly(tmp_path, "decodes to more than 1048576 bytes", within_s=0.5)
    db = Db(tmp_path / "node")  # a node that states no size: the same 1 MiB, whatever the database allows
    root = db.add(leaf({b"k": bytes(2 << 20)}), compress=True, content_size=False)
    _refused_quickly(db.commit(root, 0, max_decoded=16 << 20), "decodes to more than 1048576 bytes")


def test_counts_past_the_bytes_left_are_refused_before_anything_is_built(tmp_path: Path) -> None:
    db = Db(tmp_path)
    body = b"\x00" + table([]) + varint(1 << 40) + b"\x00" * 64  # a leaf "of a trillion keys" in 70 bytes
    _refused_quickly(db.commit(db.add(body), 0, max_decoded=16 << 20), f"{1 << 40} entries claimed", within_s=0.5)


def test_a_data_file_that_is_not_a_regular_file_is_refused_without_blocking(tmp_path: Path) -> None:
    """A FIFO planted as the data file: opening it for reading blocked the reader until someone wrote to it."""
    db = Db(tmp_path)
    root = db.commit(db.add(leaf({b"k": b"v"})), 0)
    (root / DATA).unlink()
    os.mkfifo(root / DATA)
    _refused_quickly(root, "not a regular file", within_s=0.5)


def test_a_value_read_whole_is_bounded(tmp_path: Path) -> None:
    db = Db(tmp_path)
    (tmp_path / "d").mkdir()
    body = (b"\x00" + table([DATA]) + varint(1) + varint(1) + b"k" + varint(100 << 20) + varint(1)
            + varint(0) + varint(0))
    root = db.commit(db.add(body), 0)
    with open(root / DATA, "ab") as f:
        f.truncate(200 << 20)  # sparse: the value lies inside the file
    with pytest.raises(OcdbtRefusedError, match="more than the 67108864 read whole"):
        OcdbtIndex(root).read("k")


def test_the_sidecar_does_not_hand_a_refused_database_to_tensorstore(tmp_path: Path) -> None:
    """The zarr index of a step in the sidecar: a refused database is that item's ``ArrayIndexError`` at once
    (tensorstore, asked before, reads it again from the start)."""
    item = forged_step(tmp_path / "1")
    aliased_tree(item)
    started = time.monotonic()
    with pytest.raises(ArrayIndexError, match=r"OCDBT index refused: .*not a plain path"):
        read_array_index(tmp_path / "1")
    assert time.monotonic() - started < 2
