"""The benchmarks' cold reads evict exactly the files they name from the page cache (bench/common.py).

``evict_from_page_cache`` replaced ``echo 3 > /proc/sys/vm/drop_caches``, which also flagged every page of
shared memory so that the kernel stopped mapping them ahead (docs/benchmarks.md): what it evicts is checked
here with ``mincore`` on the files themselves.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from bench.common import evict_from_page_cache
from tests.support.helpers import REPO

PAGE = mmap.PAGESIZE


def _resident_pages(path: Path) -> int:
    """How many of ``path``'s pages are in the page cache (``mincore`` on a read-only map; maps no page)."""
    size = path.stat().st_size
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as m:
        addr = np.frombuffer(m, np.uint8).ctypes.data
        pages = (size + PAGE - 1) // PAGE
        vec = (ctypes.c_ubyte * pages)()
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore")
        return sum(b & 1 for b in vec)


def _disk_dir(tmp_path: Path) -> Path:
    """``tmp_path``, or a directory in the checkout when that is in memory (tmpfs files cannot be evicted)."""
    fstype = subprocess.run(["stat", "-f", "-c", "%T", str(tmp_path)], capture_output=True, text=True).stdout.strip()
    if fstype not in ("tmpfs", "ramfs"):
        return tmp_path
    own = REPO / ".pytest_cache" / f"cold-reads-{os.getpid()}"
    own.mkdir(parents=True, exist_ok=True)
    return own


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="posix_fadvise is Linux's")
def test_the_named_files_are_evicted_and_no_other(tmp_path: Path) -> None:
    base = _disk_dir(tmp_path)
    step = base / "step"
    (step / "d").mkdir(parents=True)
    named = [step / "a.bin", step / "d" / "b.bin"]
    other = base / "other.bin"
    payload = np.random.default_rng(0).integers(0, 255, 4 << 20, dtype=np.uint8).tobytes()
    for path in [*named, other]:
        path.write_bytes(payload)
        path.read_bytes()  # in the page cache now
        assert _resident_pages(path) > 0, path
    assert evict_from_page_cache(step)
    assert [_resident_pages(p) for p in named] == [0, 0]
    assert _resident_pages(other) == (len(payload) + PAGE - 1) // PAGE  # not under the roots: untouched
    assert [p.read_bytes() == payload for p in named] == [True, True]  # evicted, not changed
    assert evict_from_page_cache(other) and _resident_pages(other) == 0  # a file may be named itself
