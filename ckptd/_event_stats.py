"""Counts and running aggregates of a job's events (``EventStats``): what the event summary keeps of folded events
(``ckptd/events/_event_summary.py``) and what the metrics count on arrival (``ckptd/_metrics.py``).

Below both, so that the metrics read the catalog's figures without importing the catalog. Stored inside the
summary (``<root>/<job>/.ckptd/events/summary.json``): a field renamed here is a change of that format.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from trainer_client.core.protocol import EVENT_KINDS, MAX_COUNT, StoredEvent

RECENT_VALUES = 256  # most recent values kept per statistic (medians, histograms to rebuild)
_KNOWN_KINDS = frozenset(EVENT_KINDS)
# A count read back from the summary on storage (anyone who can write the root can write one): the metrics
# count it in, as floats (an integer no float holds would fail there as an OverflowError at every scrape).
_Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]


class Stat(BaseModel):
    """Running aggregate of one measured quantity."""

    model_config = ConfigDict(extra="ignore")

    count: _Count = 0
    total: float = 0.0
    min: float | None = None
    max: float | None = None
    recent: list[float] = Field(default_factory=list, description="the newest values, oldest first")

    def add(self, value: float) -> None:
        self.count += 1
        self.total += value
        self.min = value if self.min is None else min(self.min, value)
        self.max = value if self.max is None else max(self.max, value)
        self.recent.append(value)
        del self.recent[:-RECENT_VALUES]

    def merged(self, later: Stat) -> Stat:
        """This (older) aggregate followed by ``later``."""
        lows = [v for v in (self.min, later.min) if v is not None]
        highs = [v for v in (self.max, later.max) if v is not None]
        return Stat(count=self.count + later.count, total=self.total + later.total,
                    min=min(lows) if lows else None, max=max(highs) if highs else None,
                    recent=(self.recent + later.recent)[-RECENT_VALUES:])

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count else None


RECOVERY_TIERS = ("replicas", "memory", "storage", "peer", "none", "unknown")


def recovery_tier(restored_from: str | None) -> str:
    """The tier a ``recovered`` event's ``restored_from`` names (``replicas``, ``memory: PATH``, ...): one of
    ``RECOVERY_TIERS`` (``unknown``: not said, or a name this ckptd does not know; ``none``: a fresh start)."""
    if restored_from is None:
        return "unknown"
    tier = restored_from.split(":", 1)[0].strip()
    return tier if tier in RECOVERY_TIERS else "unknown"


class EventStats(BaseModel):
    """Counts and measured quantities over a set of events (kinds outside ``EVENT_KINDS`` count as ``other``)."""

    model_config = ConfigDict(extra="ignore")

    events: _Count = 0
    first_time: float | None = None
    last_time: float | None = None
    kinds: dict[str, _Count] = Field(default_factory=dict)
    recovery_seconds: Stat = Field(default_factory=Stat, description="recovered: failure until the first step after")
    lost_steps: Stat = Field(default_factory=Stat, description="recovered: steps done again")
    save_stall_seconds: Stat = Field(default_factory=Stat, description="checkpoint_started: loop blocked by the save")
    recovered_from: dict[str, _Count] = Field(default_factory=dict,
                                           description="recovered: how many restored from each tier (recovery_tier)")

    def add(self, events: Iterable[StoredEvent]) -> EventStats:
        for e in events:
            self.events += 1
            self.first_time = e.time if self.first_time is None else min(self.first_time, e.time)
            self.last_time = e.time if self.last_time is None else max(self.last_time, e.time)
            kind = e.kind if e.kind in _KNOWN_KINDS else "other"
            self.kinds[kind] = self.kinds.get(kind, 0) + 1
            if e.kind == "recovered":
                if e.recovery_seconds is not None:
                    self.recovery_seconds.add(e.recovery_seconds)
                if e.lost_steps is not None:
                    self.lost_steps.add(float(e.lost_steps))
                tier = recovery_tier(e.restored_from)
                self.recovered_from[tier] = self.recovered_from.get(tier, 0) + 1
            elif e.kind == "checkpoint_started" and e.blocked_seconds is not None:
                self.save_stall_seconds.add(e.blocked_seconds)
        return self

    def merged(self, later: EventStats) -> EventStats:
        """This (older) aggregate followed by ``later``."""
        firsts = [t for t in (self.first_time, later.first_time) if t is not None]
        lasts = [t for t in (self.last_time, later.last_time) if t is not None]
        kinds = dict(self.kinds)
        for kind, n in later.kinds.items():
            kinds[kind] = kinds.get(kind, 0) + n
        tiers = dict(self.recovered_from)
        for tier, n in later.recovered_from.items():
            tiers[tier] = tiers.get(tier, 0) + n
        return EventStats(
            events=self.events + later.events, first_time=min(firsts) if firsts else None,
            last_time=max(lasts) if lasts else None, kinds=kinds,
            recovery_seconds=self.recovery_seconds.merged(later.recovery_seconds),
            lost_steps=self.lost_steps.merged(later.lost_steps),
            save_stall_seconds=self.save_stall_seconds.merged(later.save_stall_seconds), recovered_from=tiers,
        )


__all__ = ["RECENT_VALUES", "RECOVERY_TIERS", "EventStats", "Stat", "recovery_tier"]
