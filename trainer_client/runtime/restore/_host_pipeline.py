"""Host buffers to the devices as each becomes ready: the pipeline of the restores that read host memory.

A restore from the shared-memory tier or straight from an Orbax step reads each array's bytes into host
buffers (and checks them), then hands them to jax. Done one after the other, the reads and checks of the
whole state come first and the host-to-device transfer after, each at its own rate. ``stream_to_devices``
overlaps them: ``prepare`` (read and check one array's bytes) runs on a pool of threads, ``build`` (make
the jax array from them: ``jax.make_array_from_callback``, whose transfer runs on in the background on an
accelerator) runs on the calling thread as soon as an array's bytes are ready and checked. Nothing is built
from bytes whose ``prepare`` did not finish: an array whose check fails is never built, and when any fails,
the arrays built already are deleted and the first failure (in ``items`` order) is raised; nothing is
returned.

The host buffers an array was built from are held until its transfer is complete (``block_until_ready``),
also when a failure ends the pipeline: no transfer reads memory that was freed or unmapped. With a
``budget``, the buffers held at once (being read, or read and not yet on the devices) stay within that many
bytes (one item larger than it alone): a thread that needs room waits for the oldest transfers to complete
and frees their buffers.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from typing import Any, Generic, TypeVar

import jax

# On accelerators: host buffers a restore holds at once before their arrays are on the devices.
ACCELERATOR_HOST_BYTES = 4 << 30
T = TypeVar("T")
H = TypeVar("H")


class _Room(Generic[H]):
    """Bytes of host buffers held at once, and the transfers whose completion frees them."""

    def __init__(self, budget: int | None) -> None:
        self.budget = budget
        self.held = 0
        self.cond = threading.Condition()
        self.transferring: collections.deque[tuple[Any, H, int]] = collections.deque()

    def take(self, nbytes: int) -> None:
        if self.budget is None:
            return
        with self.cond:
            while self.held and self.held + nbytes > self.budget:
                if self.transferring:
                    array, host, size = self.transferring.popleft()
                    self.cond.release()
                    try:
                        jax.block_until_ready(array)
                    finally:
                        del host  # its transfer is done: the buffers may go
                        self.cond.acquire()
                    self.held -= size
                    self.cond.notify_all()
                else:  # the room is held by reads in progress: the calling thread builds them soon
                    self.cond.wait()
            self.held += nbytes

    def built(self, array: Any, host: H, nbytes: int) -> None:
        """``array`` was built from ``host``: held until its transfer is done (by ``take`` or ``finish``)."""
        with self.cond:
            self.transferring.append((array, host, nbytes))
            self.cond.notify_all()

    def finish(self) -> list[Any]:
        """Wait for every transfer still held and let its buffers go; the arrays built, oldest first."""
        with self.cond:
            held = list(self.transferring)
            self.transferring.clear()
        try:
            jax.block_until_ready([array for array, _, _ in held])
        finally:
            arrays = [array for array, _, _ in held]
            held.clear()  # the host buffers go only now
        return arrays

    def give_back(self, nbytes: int) -> None:
        """Room of an item that was never built (it failed, or was cancelled after taking room)."""
        if self.budget is None:
            return
        with self.cond:
            self.held -= nbytes
            self.cond.notify_all()


def stream_to_devices(items: Sequence[T], sizes: Sequence[int], prepare: Callable[[T], H],
                      build: Callable[[T, H], Any], *, threads: int, budget: int | None = None) -> list[Any]:
    """``build(item, prepare(item))`` of every item, in ``items`` order; ``prepare`` runs on ``threads``
    threads and each ``build`` on this thread as soon as its item is prepared. ``sizes``: the host bytes
    each item's ``prepare`` holds until its array is on the devices (counted against ``budget``; None: no
    limit, as on CPU devices, where the buffers are the arrays)."""
    room: _Room[H] = _Room(budget)
    out: list[Any] = [None] * len(items)
    failed: dict[int, BaseException] = {}
    ready: list[H | None] = [None] * len(items)  # not a future's result: that would hold it to the end

    def job(k: int) -> None:
        room.take(sizes[k])
        try:
            ready[k] = prepare(items[k])
        except BaseException:
            room.give_back(sizes[k])
            raise

    with ThreadPoolExecutor(max(1, min(threads, len(items))), thread_name_prefix="ckptd-to-device") as pool:
        futures: dict[Future[None], int] = {pool.submit(job, k): k for k in range(len(items))}
        try:
            for future in as_completed(futures):
                k = futures[future]
                if future.cancelled():
                    continue
                error = future.exception()
                if error is not None:
                    failed[k] = error
                    for other in futures:  # what has not started never will; what runs is waited for
                        other.cancel()
                    continue
                host, ready[k] = ready[k], None
                if failed:
                    room.give_back(sizes[k])
                    continue
                try:
                    out[k] = build(items[k], host)  # type: ignore[arg-type]  # prepared: not None
                except BaseException as exc:
                    failed[k] = exc
                    room.give_back(sizes[k])
                    for other in futures:
                        other.cancel()
                    continue
                room.built(out[k], host, sizes[k])  # type: ignore[arg-type]
                del host
        except BaseException as exc:  # interrupted: the pool's exit below still waits for every read running
            failed.setdefault(-1, exc)
            for other in futures:
                other.cancel()
    room.finish()  # every transfer done before the host buffers go
    built = [array for array in out if array is not None]
    if failed:
        for array in built:
            _delete(array)
        raise failed[min(failed)]
    return out


def _delete(array: Any) -> None:
    delete = getattr(array, "delete", None)
    if delete is not None:
        with contextlib.suppress(RuntimeError):  # already deleted
            delete()


__all__ = ["ACCELERATOR_HOST_BYTES", "stream_to_devices"]
