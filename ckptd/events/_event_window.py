"""What one ckptd holds in memory of a job's events, and the limits that bound it (``ckptd.events._events``).

A job's *window* is the events of its files not yet folded into its summary, plus the summary's carry
(``ckptd.events._event_summary``). ``EventLimits`` bounds each job's window (events and bytes: past them
the oldest files are folded) and all windows together in memory (``memory_bytes``: file bytes plus
``PER_EVENT_MEMORY`` per event, the jobs used least recently are dropped first and read again when asked).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from ckptd.events._event_summary import EventSummary, unique_events
from trainer_client.core.protocol import Goodput, StoredEvent

PER_EVENT_MEMORY = 1536  # bytes an event takes in memory beyond its JSON (a pydantic model: measured ~1.4 KB)


@dataclass(frozen=True)
class EventLimits:
    """What one ckptd keeps of each job's events (None: no bound, what the read-only CLI uses)."""

    max_events: int | None = None
    max_bytes: int | None = None
    memory_bytes: int | None = None
    stale_s: float = 600.0  # a run silent this long is folded as it stands (ckptd/events/_goodput_fold.py)

    @property
    def rotates(self) -> bool:
        return self.max_events is not None or self.max_bytes is not None


@dataclass
class JobWindow:
    """What this process holds of one job's events: the window of files kept, and its summary."""

    lock: threading.RLock = field(default_factory=threading.RLock)
    files: dict[str, tuple[int, list[StoredEvent]]] = field(default_factory=dict)  # name -> (size, events)
    summary: EventSummary | None = None
    summary_key: tuple[object, ...] | None = None  # (size, mtime) of summary.json when read
    signature: int | None = None  # of the listing last synced: the window changes when it does
    resident: bool = False
    goodput: tuple[tuple[object, ...], Goodput] | None = None
    _events: int = 0
    _bytes: int = 0

    def add(self, name: str, size: int, events: list[StoredEvent]) -> None:
        self.drop(name)
        self.files[name] = (size, events)
        self._events, self._bytes = self._events + len(events), self._bytes + size

    def drop(self, name: str) -> None:
        gone = self.files.pop(name, None)
        if gone is not None:
            self._events, self._bytes = self._events - len(gone[1]), self._bytes - gone[0]

    def clear(self) -> None:
        self.files.clear()
        self._events = self._bytes = 0

    def counts(self) -> tuple[int, int]:
        """(events, bytes) of the window's files."""
        return self._events, self._bytes

    def memory(self) -> int:
        events, size = self.counts()
        carry = len(self.summary.carry) if self.summary is not None else 0
        return size + (events + carry) * PER_EVENT_MEMORY

    def window(self) -> list[StoredEvent]:
        """The events kept, oldest first, each id once."""
        carry = self.summary.carry if self.summary is not None else []
        return unique_events([*carry, *(e for name in sorted(self.files) for e in self.files[name][1])])

__all__ = ["PER_EVENT_MEMORY", "EventLimits", "JobWindow"]
