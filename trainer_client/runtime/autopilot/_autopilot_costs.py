"""What each checkpoint tier costs the run, as the run measures it: the autopilot's inputs besides the failures.

Why it exists: the period model (``trainer_client.core.planning``) chooses from costs, and the runner already
sees every one of them go by, in its step boundaries and its own events; this module keeps them, per tier, as
medians of recent windows, jax-free and on an injected clock (the tests script them). The replica tier's costs
are its pacer's (``RunnerReplicas.measured``: the loop time a snapshot costs all told, and its copy); the rest:

* the step time: the median interval between consecutive step boundaries (none across a recovery);
* a save's block: ``blocked_seconds`` of ``checkpoint_started``, by where the save went (``memory`` and
  ``memory+persist`` are the shared-memory tier's snapshot, ``storage`` Orbax's device-to-host copy);
* a save's copy (until it is usable): a snapshot is usable when its save returns; a persist by ckptd when ckptd
  marks the snapshot persisted (``persisted_at``: its ``persisted.json``), timed from the save's wall time; an
  Orbax save when the writer is no longer busy (``storage_busy``), looked at the step boundaries after it;
* a recovery: detection (``failure_detected`` until ``slices_ready``), the restore (``slices_ready`` until
  ``restored``, by the tier it names) and the first step after it (until ``first_step_done``, less a step).

``version`` counts the measurements: a choice needs revising only after a new one (the hot path compares two
integers). ``CostMeter.measured`` is what the period model is fed of them (``MeasuredCosts``, by name); in a
multi-controller job every process's are pooled as the slowest's (``MeasuredCosts.slowest``) and carry between
processes as JSON, checked on reading (``MeasuredCosts.checked``).

Besides the times, what the tiers hold and write (``Footprint``, read when a choice is made): the host memory of
the shared-memory tier at its peak, and what a save writes to storage, its bytes and its arrays; a save's
requests to storage are not seen by the trainer (ckptd or Orbax make them), so they are estimated from its arrays
(``estimated_requests``) unless the user gives them.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from trainer_client.core.protocol import MEMORY_AND_PERSIST, Tier

# requests one process's save of a step makes on an object store, as measured on the GCS emulator (docs/gcs.md,
# "Requests": 101-104 for 8 arrays, about 56 for 2): a fixed part and a part per array. An upper estimate for a
# multi-host job's parts (docs/gcs.md: ~14 a host of 3 arrays, where this says 64)
REQUESTS_PER_SAVE = 40
REQUESTS_PER_ARRAY = 8
WINDOW = 16  # samples kept of each measure: recent enough to follow a change, enough for a stable median
STEP_WINDOW = 64
MIN_STEPS = 3  # step intervals before the step time is known (the first after a start compiles)
_PENDING_PERSISTS = 8  # persists waited for at once (a snapshot evicted before it was seen persisted is forgotten)
MAX_SECONDS = 1e7  # a measured time longer than this (about 115 days) is not one
MAX_BYTES = float(1 << 60)  # nor a host's memory larger than this
MAX_VERSION = 1 << 53
# the measures the period model is fed (``MeasuredCosts``): seconds, but ``memory_bytes``
COST_NAMES = frozenset({"step", "detect", "memory_bytes", "block/memory", "block/storage", "copy/storage",
                        "copy/persist", *(f"{kind}/{tier.value}" for kind in ("restore", "first_step")
                                          for tier in Tier)})


def estimated_requests(arrays: int, processes: int = 1) -> float:
    """Storage requests one save of ``arrays`` arrays makes, every one of ``processes`` processes writing its part."""
    return float(max(1, processes) * (REQUESTS_PER_SAVE + REQUESTS_PER_ARRAY * max(0, arrays)))


def _nothing_held() -> int:
    return 0


def _nothing_saved() -> tuple[int, int] | None:
    return None


@dataclass(frozen=True)
class Footprint:
    """What the run's tiers hold and write, as the runner knows it when a choice is made: ``memory_bytes()``, the
    host memory the shared-memory tier holds at its peak (0: not known yet); ``step_size()``, what a save writes to
    storage, every host together, as ``(bytes, arrays)`` (None before the first save). The replica tier's host
    memory is its own (``PacedReplicas.host_bytes``)."""

    memory_bytes: Callable[[], int] = _nothing_held
    step_size: Callable[[], tuple[int, int] | None] = _nothing_saved


@dataclass(frozen=True)
class MeasuredCosts:
    """What the period model is fed of one process's measurements (``CostMeter.measured``), by name
    (``COST_NAMES``): ``step``, the step time; ``block/<memory|storage>`` and ``copy/<storage|persist>``, a save's
    block and copy; ``restore/<tier>`` and ``first_step/<tier>``, a recovery's; ``detect``, a failure's detection
    (seconds, medians); ``memory_bytes``, the shared-memory tier's host memory at its peak. A name missing is not
    measured yet. ``version``: the count of measurements behind them (a choice needs making again only when it
    moved)."""

    values: Mapping[str, float]
    version: int = 0

    def get(self, name: str) -> float | None:
        return self.values.get(name)

    def slowest(self, others: Iterable[MeasuredCosts]) -> MeasuredCosts:
        """These costs pooled with ``others`` (a job's other processes'): each measure the largest (the job waits
        for its slowest host; the largest tier must fit), known once every one of them has measured it (a choice
        is not made from the fast ones alone); the versions added."""
        values, version = dict(self.values), self.version
        for other in others:
            version += other.version
            values = {name: max(value, other.values[name]) for name, value in values.items() if name in other.values}
        return MeasuredCosts(values, version)

    def wire(self) -> dict[str, Any]:
        return {"version": self.version, "values": dict(self.values)}

    @classmethod
    def checked(cls, value: Any) -> MeasuredCosts:
        """Costs read from another process (``wire``'s, parsed JSON); ``ValueError`` for anything else: an unknown
        measure, a value that is not a finite number from 0 to ``MAX_SECONDS`` (``MAX_BYTES`` for bytes)."""
        if not isinstance(value, dict) or set(value) != {"version", "values"}:
            raise ValueError("measured costs are an object of version and values")
        version, values = value["version"], value["values"]
        if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version <= MAX_VERSION:
            raise ValueError(f"a count of measurements of {version!r}")
        if not isinstance(values, dict):
            raise ValueError(f"measured costs of {values!r:.100}")
        if unknown := sorted(set(values) - COST_NAMES):
            raise ValueError(f"unknown measures {unknown[:3]!r:.200}: known are {sorted(COST_NAMES)}")
        for name, number in values.items():
            top = MAX_BYTES if name == "memory_bytes" else MAX_SECONDS
            # the range first: it refuses NaN and infinities, and an integer too large for a float, which
            # math.isfinite would raise OverflowError on
            if (isinstance(number, bool) or not isinstance(number, (int, float)) or not 0 <= number <= top
                    or not math.isfinite(number)):
                raise ValueError(f"measured {name} of {number!r}: not a number from 0 to {top:g}")
        return cls({name: float(number) for name, number in values.items()}, version)


class Samples:
    """A window of one measure; ``median`` is None while it is empty."""

    def __init__(self, size: int = WINDOW) -> None:
        self._values: deque[float] = deque(maxlen=size)

    def add(self, value: float) -> None:
        self._values.append(max(0.0, value))

    def median(self) -> float | None:
        return statistics.median(self._values) if self._values else None

    def __len__(self) -> int:
        return len(self._values)


class CostMeter:
    """The costs of the run's tiers, from its step boundaries (``boundary``) and its events (``observe``).

    ``persisted_at(step)``: when ckptd marked the shared-memory snapshot of ``step`` persisted (wall time), None
    while it is not; ``storage_busy()``: whether an Orbax save is still being written. ``clock``: monotonic
    seconds; ``wall``: the wall clock the snapshots' persist marks are on."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time,
                 persisted_at: Callable[[int], float | None] | None = None,
                 storage_busy: Callable[[], bool] | None = None) -> None:
        self.clock, self.wall = clock, wall
        self._persisted_at = persisted_at
        self._storage_busy = storage_busy
        self._steps: deque[float] = deque(maxlen=STEP_WINDOW)
        self._last: float | None = None
        self.block: dict[str, Samples] = {Tier.MEMORY: Samples(), Tier.STORAGE: Samples()}
        self.copy: dict[str, Samples] = {Tier.STORAGE: Samples(), "persist": Samples()}
        self.restore: dict[str, Samples] = {}
        self.first_step: dict[str, Samples] = {}
        self.detect = Samples()
        self.version = 0
        self._failed_at: float | None = None
        self._ready_at: float | None = None
        self._restored: tuple[str, float] | None = None  # the tier restored from and when
        self._persists: dict[int, float] = {}  # step -> wall time of its save (a persist by ckptd waited for)
        self._writing: float | None = None  # when the Orbax save being written started

    # ---- the loop ------------------------------------------------------------------------------

    def boundary(self) -> None:
        """A step boundary now: the step interval since the last one, and an Orbax save seen finished."""
        now = self.clock()
        if self._last is not None:
            self._steps.append(now - self._last)
        self._last = now
        if self._writing is not None and self._storage_busy is not None and not self._storage_busy():
            self._measured(self.copy[Tier.STORAGE], now - self._writing)
            self._writing = None

    def step_s(self) -> float | None:
        return statistics.median(self._steps) if len(self._steps) >= MIN_STEPS else None

    def poll_persists(self) -> None:
        """Look for the persists waited for (a file read each): called when a choice is about to be made, not at
        every boundary."""
        if self._persisted_at is None:
            return
        for step, saved in list(self._persists.items()):
            done = self._persisted_at(step)
            if done is not None:
                del self._persists[step]
                self._measured(self.copy["persist"], done - saved)

    # ---- the runner's events ---------------------------------------------------------------------

    def observe(self, kind: str, step: int | None, fields: Mapping[str, Any]) -> None:
        now = self.clock()
        if kind == "failure_detected" or kind == "scale_up_detected":
            self._failed_at = now if kind == "failure_detected" else None
            self._writing = None  # an Orbax save in flight is reset with the attempt
        elif kind == "slices_ready":
            if self._failed_at is not None:
                self._measured(self.detect, now - self._failed_at)
                self._failed_at = None
            # a new attempt: the interval across the recovery is no step's; the window goes on (a few slow steps
            # after a restore move its median little, where a window started afresh would stand on them alone)
            self._ready_at, self._last = now, None
        elif kind == "restored" and fields.get("tier"):
            tier = str(fields["tier"])
            if self._ready_at is not None:
                self._measured(self.restore.setdefault(tier, Samples()), now - self._ready_at)
            self._ready_at, self._restored = None, (tier, now)
        elif kind == "first_step_done" and self._restored is not None:
            tier, at = self._restored
            self._restored = None
            self._measured(self.first_step.setdefault(tier, Samples()), now - at - (self.step_s() or 0.0))
        elif kind == "checkpoint_started":
            self._saved(step, fields.get("tier"), fields.get("blocked_seconds"), now)

    def _saved(self, step: int | None, tier: object, blocked: object, now: float) -> None:
        if not isinstance(blocked, (int, float)) or tier not in (Tier.MEMORY, MEMORY_AND_PERSIST, Tier.STORAGE):
            return  # skipped, or a save whose stall was not timed
        self._measured(self.block[Tier.STORAGE if tier == Tier.STORAGE else Tier.MEMORY], float(blocked))
        if tier == Tier.STORAGE:
            self._writing = now - float(blocked)
        elif tier == MEMORY_AND_PERSIST and step is not None:
            self._persists[step] = self.wall() - float(blocked)
            while len(self._persists) > _PENDING_PERSISTS:
                del self._persists[min(self._persists)]

    def _measured(self, samples: Samples, value: float) -> None:
        samples.add(value)
        self.version += 1

    # ---- what is known ---------------------------------------------------------------------------

    def measured(self, memory_bytes: int = 0) -> MeasuredCosts:
        """What is known now, with the shared-memory tier's host memory (``Footprint.memory_bytes``; 0: not known)."""
        windows = {"detect": self.detect, **{f"block/{name}": s for name, s in self.block.items()},
                   **{f"copy/{name}": s for name, s in self.copy.items()},
                   **{f"restore/{name}": s for name, s in self.restore.items()},
                   **{f"first_step/{name}": s for name, s in self.first_step.items()}}
        values = {name: s.median() for name, s in windows.items()} | {"step": self.step_s()}
        if memory_bytes > 0:
            values["memory_bytes"] = float(memory_bytes)
        return MeasuredCosts({name: float(v) for name, v in values.items() if v is not None and name in COST_NAMES},
                             self.version)


__all__ = ["COST_NAMES", "MAX_BYTES", "MAX_SECONDS", "REQUESTS_PER_ARRAY", "REQUESTS_PER_SAVE", "CostMeter",
           "Footprint", "MeasuredCosts", "Samples", "estimated_requests"]
