"""The disk's own limit, the baseline of ``persist_throughput_ratio_vs_disk_limit`` and
``restore_throughput_ratio_vs_disk_limit``.

One numpy ``tofile`` stream is not what the disk can do: parallel writers beat it (Orbax without
compression measured 2.35x one stream), so a ratio against one stream says nothing about how close a path
is to the hardware. Here the same bytes are written by 1, 2, 4 and 8 parallel writers (each its share into
its own file, then ``fsync``) and read back cold (evicted from the page cache) by 1, 2, 4, 8 and 16 parallel readers
(64 MiB ``preadv`` pieces of the step's own data files, so as many requests outstanding as readers: the
direct restore keeps 16); the best of each sweep is the limit. ``fio`` is not installed on these machines;
threads calling ``os.write``/``os.preadv`` (which release the GIL) keep every request in the kernel, which
is what fio's psync engine does too.

A sweep is run once per family (``write_sweep``/``read_sweep``); then each repeat times the winning writer
or reader count beside the path it is the baseline of (``write_limit``/``read_limit``), so the ratio is
formed within one repeat like every other.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from bench.common import evict_from_page_cache, rmtree, timed

WRITERS = (1, 2, 4, 8)
READERS = (1, 2, 4, 8, 16)
PIECE = 64 << 20


def _balance(sizes: Sequence[int], n: int) -> list[list[int]]:
    """Indices of ``sizes`` split into ``n`` groups of about equal total (largest first, to the lightest)."""
    groups: list[list[int]] = [[] for _ in range(n)]
    totals = [0] * n
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        k = totals.index(min(totals))
        groups[k].append(i)
        totals[k] += sizes[i]
    return [g for g in groups if g]


def _pieces(buffers: Sequence[np.ndarray]) -> list[memoryview]:
    """The buffers' bytes as pieces of at most ``PIECE`` bytes (so that 8 writers share even one big array)."""
    out = []
    for b in buffers:
        flat = np.ascontiguousarray(b).reshape(-1).view(np.uint8).data
        out += [flat[o : o + PIECE] for o in range(0, len(flat), PIECE)]
    return out


def write_limit(buffers: Sequence[np.ndarray], directory: Path, writers: int) -> float:
    """Seconds for ``writers`` threads to write ``buffers`` (each its share into its own file) and fsync."""
    pieces = _pieces(buffers)
    directory.mkdir(parents=True, exist_ok=True)
    groups = _balance([len(p) for p in pieces], writers)

    def write(k: int, group: list[int]) -> None:
        fd = os.open(directory / f"writer{k}.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for i in group:
                view, done = pieces[i], 0
                while done < len(view):
                    done += os.write(fd, view[done:])
            os.fsync(fd)
        finally:
            os.close(fd)

    os.sync()
    try:
        with timed() as t, ThreadPoolExecutor(len(groups)) as pool:
            for _ in pool.map(lambda kg: write(*kg), enumerate(groups)):
                pass
            dir_fd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        return t.seconds
    finally:
        rmtree(directory)


def data_files(step_dir: Path) -> list[Path]:
    """An Orbax step's OCDBT data files (``<item>/ocdbt.process_<n>/d/*``): the bytes its arrays are in."""
    return sorted(p for p in step_dir.rglob("*") if p.is_file() and p.parent.name == "d")


def read_limit(files: Sequence[Path], readers: int, *, cold: bool = True) -> float:
    """Seconds for ``readers`` threads to read every byte of ``files`` (64 MiB pieces, the files evicted from
    the page cache first when ``cold``), each into a buffer of its own that it reuses."""
    jobs = [(f, o, min(PIECE, f.stat().st_size - o)) for f in files for o in range(0, f.stat().st_size, PIECE)]
    fds = {f: os.open(f, os.O_RDONLY) for f in files}
    buffers = [np.empty(PIECE, np.uint8) for _ in range(min(readers, len(jobs)) or 1)]
    try:
        if cold:
            evict_from_page_cache(*files)

        def read(k: int) -> None:
            view = buffers[k].data
            for j in range(k, len(jobs), len(buffers)):
                path, offset, length = jobs[j]
                done = 0
                while done < length:
                    n = os.preadv(fds[path], [view[done:length]], offset + done)
                    if n <= 0:
                        raise OSError(f"{path}: short read at {offset + done}")
                    done += n

        with timed() as t, ThreadPoolExecutor(len(buffers)) as pool:
            for _ in pool.map(read, range(len(buffers))):
                pass
        return t.seconds
    finally:
        for fd in fds.values():
            os.close(fd)


def sweep(run: Callable[[int], float], counts: Sequence[int]) -> tuple[int, dict[int, float]]:
    """``run(n)`` for every count; (the fastest count, seconds by count)."""
    seconds = {n: run(n) for n in counts}
    return min(seconds, key=lambda n: seconds[n]), seconds


def write_sweep(buffers: Sequence[np.ndarray], directory: Path) -> tuple[int, dict[int, float]]:
    return sweep(lambda n: write_limit(buffers, directory / f"sweep-{n}", n), WRITERS)


def read_sweep(files: Sequence[Path], *, cold: bool = True) -> tuple[int, dict[int, float]]:
    return sweep(lambda n: read_limit(files, n, cold=cold), READERS)


__all__ = ["READERS", "WRITERS", "data_files", "read_limit", "read_sweep", "write_limit", "write_sweep"]
