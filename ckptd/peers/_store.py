"""A host's shared memory as the peer channel sees it: where a received part goes, how it is checked before it
counts, and which copies go when their original does (docs/multihost.md, "Peer copies").

A part arrives into a staging directory of its own (``.in-<random>``, 0700, its files created exclusively,
0600: the memory tier's rules, ``trainer_client/core/format/_private_files.py``), is checked as a snapshot
(``problems``) and shard by shard against the checksums its ``snapshot.json`` records (``damaged_shards``),
and only then renamed into place: a copy of host k's part under ``<job>/.peer-<k>/<step>/``, or, when a host
brings its own part back, ``<job>/<step>/`` itself. A part that fails a check is deleted, never used.

Room is charged before a byte is received (``reserve``): under one lock, what the copies held, the copies being
received and the new one come to is checked against the capacity, and the free space less everything being
received against the reserve kept for the trainer; the charge is held until the part is in place (or deleted).
Concurrent receives can never together pass either bound.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from pydantic import ValidationError

from ckptd.peers._protocol import Channel, PeerError
from trainer_client.core.format import (
    FROM_PEER_FILE,
    MAX_META_BYTES,
    SNAPSHOT_DATA_FILE,
    SNAPSHOT_META_FILE,
    SnapshotMeta,
    check_private_dir,
    copies_dir,
    damaged_shards,
    ensure_private_dir,
    is_real_dir,
    make_private_dir,
    map_data,
    open_private,
    problems,
    read_private,
    write_private,
)
from trainer_client.core.protocol import is_valid_job_name

RESERVE_BYTES = 256 << 20  # what a received copy must leave free in shared memory (the trainer's next save)
_STEP = re.compile(r"^[0-9]{1,19}$")
_STAGING = ".in-"


def check_job(job: object) -> str:
    if not isinstance(job, str) or not is_valid_job_name(job):
        raise PeerError(f"not a job name: {str(job)[:80]!r}")
    return job


class PartStore:
    """Parts received into, and read out of, one host's shared-memory directory."""

    def __init__(self, shm_dir: str | Path, *, capacity_bytes: int | None = None) -> None:
        self.shm_dir = Path(shm_dir)
        self.capacity_bytes = capacity_bytes  # the copies of other hosts' parts, all jobs together (None: free space)
        self._lock = threading.Lock()
        self._charged = [0, 0]  # bytes being received: [every part, copies of other hosts' parts]

    def copy_path(self, job: str, origin: int, step: int) -> Path:
        return copies_dir(self.shm_dir, job, origin) / str(step)

    def own_path(self, job: str, step: int) -> Path:
        return self.shm_dir / job / str(step)

    def copies(self, job: str, origin: int) -> list[Path]:
        base = copies_dir(self.shm_dir, job, origin)
        try:
            return sorted((p for p in base.iterdir() if _STEP.match(p.name) and is_real_dir(p)),
                          key=lambda p: int(p.name))
        except OSError:
            return []

    def copy_bytes(self) -> int:
        """Bytes of every copy this host holds for other hosts (in place: those being received are charged by
        ``reserve``)."""
        total = 0
        for data in self.shm_dir.glob(f"*/.peer-*/*/{SNAPSHOT_DATA_FILE}"):
            if data.parent.name.startswith(_STAGING):
                continue
            with contextlib.suppress(OSError):
                total += os.lstat(data).st_size
        return total

    def room_for(self, nbytes: int, *, copy: bool) -> str | None:
        """Why ``nbytes`` more cannot be held beside what is held and being received (None: they can). Only a
        check: ``reserve`` charges them."""
        stats = os.statvfs(self.shm_dir)
        free = stats.f_bavail * stats.f_frsize - self._charged[0]
        if nbytes + RESERVE_BYTES > free:
            return (f"{nbytes} bytes do not fit in shared memory ({free} free beside the parts being received, "
                    f"{RESERVE_BYTES} kept for the trainer)")
        if copy and self.capacity_bytes is not None and \
                self.copy_bytes() + self._charged[1] + nbytes > self.capacity_bytes:
            return (f"{nbytes} bytes more would pass the peer copies' capacity of {self.capacity_bytes} bytes "
                    f"({self._charged[1]} being received)")
        return None

    @contextlib.contextmanager
    def reserve(self, nbytes: int, *, copy: bool) -> Iterator[None]:
        """Charge ``nbytes`` (a copy of another host's part: against the capacity too) for as long as the block
        runs, the check and the charge under one lock; ``PeerError`` with the reason when they do not fit."""
        with self._lock:
            reason = self.room_for(nbytes, copy=copy)
            if reason is not None:
                raise PeerError(reason)
            self._charged[0] += nbytes
            self._charged[1] += nbytes if copy else 0
        try:
            yield
        finally:
            with self._lock:
                self._charged[0] -= nbytes
                self._charged[1] -= nbytes if copy else 0

    def receive(self, chan: Channel, job: str, *, origin: int, count: int, step: int, meta_bytes: int,
                data_bytes: int, own: bool, source: int | None = None) -> Path:
        """Read one part (``meta_bytes`` of ``snapshot.json``, then ``data_bytes`` of ``data.bin``) from ``chan``,
        check it, put it in place; returns where. ``PeerError`` when anything about it is wrong (deleted)."""
        check_private_dir(self.shm_dir)
        job_dir = ensure_private_dir(self.shm_dir / check_job(job))
        parent = job_dir if own else ensure_private_dir(copies_dir(self.shm_dir, job, origin))
        final = self.own_path(job, step) if own else self.copy_path(job, origin, step)
        staging = make_private_dir(parent / f"{_STAGING}{secrets.token_hex(8)}")
        try:
            raw = chan.recv_bytes(meta_bytes)
            try:
                meta = SnapshotMeta.model_validate_json(raw)
            except ValidationError as exc:
                raise PeerError(f"not a snapshot's metadata: {str(exc).splitlines()[0][:200]}") from None
            if (meta.step, meta.process_index, meta.process_count, meta.nbytes) != (step, origin, count, data_bytes):
                raise PeerError(f"the metadata is of step {meta.step}, process {meta.process_index} of "
                                f"{meta.process_count}, {meta.nbytes} bytes: not what the header announced")
            fd = open_private(staging / SNAPSHOT_DATA_FILE, os.O_RDWR | os.O_CREAT)  # mapped: read and write
            try:
                chan.recv_into_file(fd, data_bytes)
            finally:
                os.close(fd)
            write_private(staging / SNAPSHOT_META_FILE, raw)
            if source is not None:  # where this host's own part came back from (the trainer reports it)
                write_private(staging / FROM_PEER_FILE, json.dumps({"host": source}).encode())
            self.check(staging, meta)
            if final.exists():  # held already (the same save sent twice): keep the one in place
                shutil.rmtree(staging, ignore_errors=True)
                return final
            os.rename(staging, final)
            return final
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise

    @staticmethod
    def check(path: Path, meta: SnapshotMeta) -> None:
        """``PeerError`` unless the part at ``path`` is intact: sizes and shards, and every shard's checksum."""
        found = problems(path)
        if found:
            raise PeerError(f"the part received is not intact: {found[:3]}")
        damaged = damaged_shards(map_data(path, meta), meta)
        if damaged:
            raise PeerError(f"{len(damaged)} shard(s) arrived damaged: {damaged[:2]}")

    def listing(self, job: str, origin: int) -> list[tuple[int, str | None]]:
        """``(step, save_id)`` of every intact copy of ``origin``'s parts of ``job``, oldest first."""
        out: list[tuple[int, str | None]] = []
        for path in self.copies(job, origin):
            with contextlib.suppress(OSError, ValueError, PeerError):
                if not problems(path):
                    out.append((int(path.name), SnapshotMeta.model_validate_json(
                        read_private(path / SNAPSHOT_META_FILE, max_bytes=MAX_META_BYTES)).save_id))
        return out

    def jobs_holding(self, origin: int, count: int, limit: int) -> list[str]:
        """The jobs (at most ``limit``, by name) of which this host holds an intact copy of ``origin``'s part of
        a ``count``-host save: a job that ran on another number of hosts is not the asker's."""
        try:
            jobs = sorted(p.name for p in self.shm_dir.iterdir() if is_valid_job_name(p.name) and is_real_dir(p))
        except OSError:
            return []
        found: list[str] = []
        for job in jobs:
            if len(found) >= limit:
                break
            if any(self._hosts_of(path) == count for path in reversed(self.copies(job, origin))):
                found.append(job)
        return found

    @staticmethod
    def _hosts_of(path: Path) -> int | None:
        """The host count of the save whose part is at ``path`` (None when it cannot be read whole)."""
        with contextlib.suppress(OSError, ValueError):
            if not problems(path):
                raw = read_private(path / SNAPSHOT_META_FILE, max_bytes=MAX_META_BYTES)
                return SnapshotMeta.model_validate_json(raw).process_count
        return None

    def open_part(self, path: Path) -> tuple[bytes, SnapshotMeta, BinaryIO]:
        """``(snapshot.json bytes, its metadata, data.bin opened)`` of the part at ``path``, read by this
        memory tier's rules; ``PeerError`` when it is not there or not intact."""
        if not is_real_dir(path) or problems(path):
            raise PeerError(f"no intact part at {path.name}")
        raw = read_private(path / SNAPSHOT_META_FILE, max_bytes=MAX_META_BYTES)
        meta = SnapshotMeta.model_validate_json(raw)
        return raw, meta, os.fdopen(open_private(path / SNAPSHOT_DATA_FILE), "rb")

    def prune(self, job: str, origin: int, keep: set[int]) -> int:
        """Drop the copies of ``origin``'s parts whose step is not in ``keep`` (what the origin still holds):
        a copy goes when its original does. Returns how many went."""
        dropped = 0
        for path in self.copies(job, origin):
            if int(path.name) not in keep:
                shutil.rmtree(path, ignore_errors=True)
                dropped += 1
        return dropped

    def drop_staging(self) -> int:
        """Delete what receives interrupted by a crash of this process left (at its start: none is running)."""
        dropped = 0
        for leftover in [*self.shm_dir.glob(f"*/{_STAGING}*"), *self.shm_dir.glob(f"*/.peer-*/{_STAGING}*")]:
            if is_real_dir(leftover):
                shutil.rmtree(leftover, ignore_errors=True)
                dropped += 1
        return dropped


__all__ = ["PartStore", "check_job"]
