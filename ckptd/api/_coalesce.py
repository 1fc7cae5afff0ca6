"""Identical questions asked together share one fresh answer (a "group commit" for resume requests).

When a slice fails, every host of the job asks ckptd where to resume within the same few milliseconds,
and they ask the same question. Answering each one on its own means as many storage checks (the named
step's commit marker and quarantine record) and as many worker threads queueing for the catalog: a
burst of 64 on a 2-core host spent most of its time in lock convoys, and on ``gs://`` each check is a
round trip.

``Coalescer`` answers a key at most once at a time. A request that arrives while no answer for its key
is being worked out starts one; requests that arrive while one is running wait for the *next* round,
which starts when the running one ends and which every one of them shares. So every answer still comes
from checks begun after its request arrived (nothing stale is ever answered), and a burst of any size
costs two rounds. Waiting requests hold no thread: they are awaiting futures on the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import anyio.to_thread

T = TypeVar("T")


@dataclass
class _Round(Generic[T]):
    work: Callable[[], T]
    future: asyncio.Future[T]


class Coalescer(Generic[T]):
    """Runs ``work`` for a key in a worker thread; callers that overlap a running round share the next one.

    Must be used from one event loop. An exception raised by a round reaches every caller that shared it.
    """

    def __init__(self) -> None:
        self._running: dict[Hashable, _Round[T]] = {}
        self._next: dict[Hashable, _Round[T]] = {}
        self._tasks: set[asyncio.Task[None]] = set()  # running rounds (a task nobody references may vanish)
        self.rounds = 0  # rounds started
        self.waited = 0  # callers that arrived during a round and shared the next one

    async def answer(self, key: Hashable, work: Callable[[], T]) -> T:
        """The result of a round of ``work`` for ``key`` that started after this call."""
        loop = asyncio.get_running_loop()
        if key not in self._running:
            round_ = _Round(work, loop.create_future())
            self._running[key] = round_
            self._start(key, round_)
        else:
            self.waited += 1
            following = self._next.get(key)
            if following is None:
                following = self._next[key] = _Round(work, loop.create_future())
            round_ = following
        # shield: a caller that goes away (client disconnected) does not cancel the round for the others
        return await asyncio.shield(round_.future)

    def _start(self, key: Hashable, round_: _Round[T]) -> None:
        self.rounds += 1
        task = asyncio.ensure_future(self._run(key, round_))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, key: Hashable, round_: _Round[T]) -> None:
        try:
            result = await anyio.to_thread.run_sync(round_.work)
        except asyncio.CancelledError:  # the server is shutting down
            round_.future.cancel()
            raise
        except BaseException as exc:  # delivered to every caller of this round
            round_.future.set_exception(exc)
            round_.future.add_done_callback(_retrieved)
        else:
            round_.future.set_result(result)
        finally:
            del self._running[key]
            following = self._next.pop(key, None)
            if following is not None:
                self._running[key] = following
                self._start(key, following)
            # A failed round's exception keeps this frame in its traceback: the frame must not keep the round
            # (its work, the request it answers) in turn, a cycle only the garbage collector would free.
            del round_, following


def _retrieved(future: asyncio.Future[Any]) -> None:
    """Mark a failed round's exception as seen (its callers may all have gone away)."""
    if not future.cancelled():
        future.exception()


__all__ = ["Coalescer"]
