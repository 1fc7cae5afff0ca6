"""What one GCS bucket takes under load, as rules over a clock the caller passes in: the decisions of the shaping
proxy (``tests/support/gcs_shaper.py``), with no I/O, so the ramp and the limits are tested in microseconds.

What GCS documents (cloud.google.com/storage/docs/request-rate, .../quotas):

* a bucket starts at about 1,000 object writes/s and 5,000 object reads/s;
* its capacity follows the load, but ramps at most 2x every 20 minutes; requests past what it takes now are
  answered ``429`` or ``503``, and clients are expected to back off exponentially;
* one write per second to the same object name.

The model here:

* ``RampingRate``: a rate that starts at its initial value and doubles at the end of each ramp period in which
  the bucket was asked at least ``busy_share`` of what the rate allowed over the period (refused requests
  count: they are load); at most one doubling a period, never down.
* ``TokenBucket``: admits a request when a token is there; tokens come at the rate, up to ``burst_s`` worth
  (full at the start). One per bucket for writes, one for reads.
* ``ObjectWrites``: a write to a name whose last write completed less than ``object_write_interval_s`` ago is
  refused (``429``). Writes admitted together (neither done yet) both reach the emulator; if both complete
  within the interval the pair is recorded in ``twice``: an object written twice within a second, which the
  tests assert never happens. A create-only write that loses (``412``) wrote nothing and is not a write here.
* ``classify``: what a request of the JSON API is (a read or a write, its bucket, the object it writes).

A refused write or read is answered ``429`` or ``503`` (``share_503`` of them 503, from a seeded generator);
one over the per-object limit always ``429`` (GCS's ``rateLimitExceeded``).
"""

from __future__ import annotations

import json
import math
import random
import re
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal
from urllib.parse import parse_qs, unquote, urlsplit

Clock = Callable[[], float]
Kind = Literal["read", "write", "other"]


class ManualClock:
    """A clock for the shaper (and a back-off) that moves only when told: ``now`` is set, or ``sleep`` (an asyncio
    sleep that returns at once) adds its wait, recorded in ``waits``."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now
        self.waits: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.waits.append(seconds)
        self.now += seconds


@dataclass(frozen=True)
class Limits:
    """A bucket's limits: GCS's documented starting rates and ramp, one write a second per object name."""

    write_per_s: float = 1000.0
    read_per_s: float = 5000.0
    ramp_factor: float = 2.0
    ramp_period_s: float = 1200.0
    busy_share: float = 0.5  # of a period's capacity asked: then the rate doubles at the period's end
    burst_s: float = 1.0  # a token bucket holds this many seconds of its rate (full at the start)
    object_write_interval_s: float = 1.0
    share_503: float = 0.5  # of the refusals for the bucket's rate, answered 503 (the rest 429)

    def scaled(self, factor: float) -> Limits:
        """The same bucket with both rates times ``factor`` (a bench that must not be bounded by its machine)."""
        return Limits(**{**asdict(self), "write_per_s": self.write_per_s * factor,
                         "read_per_s": self.read_per_s * factor})

    def bound_s(self, writes: int, reads: int) -> float:
        """The time the starting rates themselves allow for ``writes`` and ``reads`` (the slower of the two)."""
        return max(writes / self.write_per_s, reads / self.read_per_s)


class RampingRate:
    """A rate that doubles (``factor``) at the end of each ``period_s`` in which it was asked at least ``busy_share``
    of what it allowed over that period; the first period starts at the first request."""

    def __init__(self, initial: float, *, factor: float = 2.0, period_s: float = 1200.0,
                 busy_share: float = 0.5) -> None:
        self.rate, self.factor, self.period_s, self.busy_share = initial, factor, period_s, busy_share
        self._start: float | None = None
        self._asked = 0.0

    def at(self, now: float) -> float:
        """The rate at ``now`` (closing the periods that ended before it)."""
        if self._start is None:
            self._start = now
        if now - self._start >= self.period_s:
            if self._asked >= self.busy_share * self.rate * self.period_s:
                self.rate *= self.factor
            self._asked = 0.0
            self._start += self.period_s * math.floor((now - self._start) / self.period_s)  # idle ones: no ramp
        return self.rate

    def ask(self, now: float, n: float = 1.0) -> float:
        """Count ``n`` requests asked at ``now``; the rate then."""
        rate = self.at(now)
        self._asked += n
        return rate


class TokenBucket:
    """Admits a request when a token is there; tokens come at ``rate`` and hold ``burst_s`` of it (full at first)."""

    def __init__(self, rate: RampingRate, burst_s: float) -> None:
        self.rate, self.burst_s = rate, burst_s
        self._tokens: float | None = None
        self._last = 0.0

    def take(self, now: float) -> bool:
        rate = self.rate.ask(now)
        cap = max(1.0, rate * self.burst_s)
        tokens = cap if self._tokens is None else min(cap, self._tokens + max(0.0, now - self._last) * rate)
        self._last = now
        admitted = tokens >= 1.0
        self._tokens = tokens - 1.0 if admitted else tokens
        return admitted


@dataclass
class ObjectWrites:
    """The last completed write of every object name, the names written twice within ``interval_s``."""

    interval_s: float = 1.0
    last: dict[str, float] = field(default_factory=dict)
    counts: Counter[str] = field(default_factory=Counter)
    twice: list[tuple[str, float, float]] = field(default_factory=list)  # (name, the write before, this one)
    present: set[str] = field(default_factory=set)  # names whose last write made an object (not a deletion)

    def admit(self, name: str, now: float, *, create_only: bool = False) -> bool:
        """Whether a write of ``name`` may go on now. A create-only write where an object is writes nothing
        (the emulator answers 412), so it goes on whenever it comes."""
        before = self.last.get(name)
        return before is None or now - before >= self.interval_s or (create_only and name in self.present)

    def written(self, name: str, now: float, *, deleted: bool = False) -> None:
        before = self.last.get(name)
        if before is not None and now - before < self.interval_s:
            self.twice.append((name, before, now))
        self.last[name] = now
        self.counts[name] += 1
        if deleted:
            self.present.discard(name)
        else:
            self.present.add(name)


@dataclass(frozen=True)
class Op:
    """One request as the bucket sees it. ``name``: the object it writes (a write) or reads; ``completes``: a
    success of it is a write of ``name`` (not the start of a resumable upload, which writes nothing yet)."""

    kind: Kind
    bucket: str | None = None
    name: str | None = None
    completes: bool = False
    upload_id: str | None = None
    create_only: bool = False  # ifGenerationMatch=0: it writes only where no object is


_JSON_OBJECT = re.compile(r"^/storage/v1/b/([^/]+)/o/(.+?)(/compose|/(?:rewriteTo|copyTo)/b/[^/]+/o/(.+))?$")
_JSON_OBJECTS = re.compile(r"^/storage/v1/b/([^/]+)/o/?$")
_UPLOAD = re.compile(r"^/upload/storage/v1/b/([^/]+)/o/?$")
_DOWNLOAD = re.compile(r"^/download/storage/v1/b/([^/]+)/o/(.+)$")
_BUCKET = re.compile(r"^/storage/v1/b/([^/]+)/?$")
_XML = re.compile(r"^/([a-z0-9][a-z0-9._-]{1,220})/(.+)$")
_BODY_NAME = re.compile(rb'"name"\s*:\s*("(?:[^"\\]|\\.)*")')
_READS = {"GET", "HEAD"}


def body_name(body: bytes) -> str | None:
    """The object name in an upload's metadata (a JSON body, or a multipart body's first part)."""
    found = _BODY_NAME.search(body[:65536])
    if found is None:
        return None
    try:
        name = json.loads(found.group(1))
    except ValueError:
        return None
    return name if isinstance(name, str) else None


def classify(method: str, target: str, body: bytes, uploads: dict[str, str]) -> Op:
    """What ``method target`` (path and query, as sent) is to the bucket. ``uploads``: the resumable uploads
    started so far (upload id -> object name), which a follow-up request of an upload names only by id."""
    parts = urlsplit(target)
    path, query = parts.path, parse_qs(parts.query)
    kind: Kind = "read" if method in _READS else "write"
    if (m := _UPLOAD.match(path)) is not None:
        upload_id = query.get("upload_id", [None])[0]
        if upload_id is not None:
            return Op("write", m.group(1), uploads.get(upload_id), completes=True, upload_id=upload_id)
        name = query.get("name", [None])[0] or body_name(body)
        resumable = query.get("uploadType", [""])[0] == "resumable"
        create_only = query.get("ifGenerationMatch", [""])[0] == "0"
        return Op("write", m.group(1), name, completes=not resumable, create_only=create_only)
    if (m := _JSON_OBJECT.match(path)) is not None:
        name = unquote(m.group(4) or m.group(2))
        return Op(kind, m.group(1), name, completes=kind == "write")
    if (m := _DOWNLOAD.match(path)) is not None:
        return Op("read", m.group(1), unquote(m.group(2)))
    if (m := _JSON_OBJECTS.match(path)) is not None:
        return Op(kind, m.group(1), body_name(body) if kind == "write" else None, completes=kind == "write")
    if (m := _BUCKET.match(path)) is not None and kind == "read":
        return Op("read", m.group(1))
    if (m := _XML.match(path)) is not None and m.group(1) not in ("storage", "upload", "download", "batch"):
        return Op(kind, m.group(1), unquote(m.group(2)), completes=kind == "write")
    return Op("other")  # the bucket list, a bucket's creation: the emulator's setup, not shaped


@dataclass(frozen=True)
class Refusal:
    status: int
    reason: str  # "write_rate", "read_rate" or "object_rate"


class BucketRules:
    """The limits of every bucket behind the proxy and what they decided, counted: ``stats`` (requests,
    reads, writes, refusals by reason and status, per door), ``objects`` (writes per name, names written twice).
    Thread-safe: the proxy decides on its loop while tests read the counts."""

    def __init__(self, limits: Limits, *, clock: Clock, seed: int = 0, keep_log: bool = False) -> None:
        self.limits, self.clock = limits, clock
        self.log: list[str] | None = [] if keep_log else None  # "door METHOD target -> status", in order
        self.stats: Counter[str] = Counter()
        self.objects = ObjectWrites(limits.object_write_interval_s)
        self.uploads: dict[str, str] = {}
        self._buckets: dict[tuple[str, str], TokenBucket] = {}
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.first_at: float | None = None
        self.last_at: float | None = None

    def _bucket(self, name: str, kind: str) -> TokenBucket:
        key = (name, kind)
        if key not in self._buckets:
            limits = self.limits
            initial = limits.write_per_s if kind == "write" else limits.read_per_s
            self._buckets[key] = TokenBucket(RampingRate(initial, factor=limits.ramp_factor,
                                                         period_s=limits.ramp_period_s, busy_share=limits.busy_share),
                                             limits.burst_s)
        return self._buckets[key]

    def rate(self, bucket: str, kind: str) -> float:
        """The rate of ``kind`` (``read``/``write``) ``bucket`` takes now."""
        with self._lock:
            return self._bucket(bucket, kind).rate.at(self.clock())

    def note(self, door: str, method: str, target: str, status: int) -> None:
        """Keep one request's line in ``log`` (when kept)."""
        if self.log is not None:
            with self._lock:
                self.log.append(f"{door} {method} {target} -> {status}")

    def admit(self, op: Op, door: str = "main") -> Refusal | None:
        """None when ``op`` goes on to the emulator; else how it is refused. Counted either way."""
        with self._lock:
            now = self.clock()
            self.stats["requests"] += 1
            self.stats[f"door:{door}:requests"] += 1
            if op.kind == "other" or op.bucket is None:
                self.stats["unshaped"] += 1
                return None
            self.stats[f"{op.kind}s"] += 1
            self.stats[f"door:{door}:{op.kind}s"] += 1
            refusal = None
            if (op.kind == "write" and op.completes and op.name is not None
                    and not self.objects.admit(op.name, now, create_only=op.create_only)):
                refusal = Refusal(429, "object_rate")
            elif not self._bucket(op.bucket, op.kind).take(now):
                status = 503 if self._rng.random() < self.limits.share_503 else 429
                refusal = Refusal(status, f"{op.kind}_rate")
            if refusal is None:
                self.stats[f"admitted_{op.kind}s"] += 1
                self.stats[f"door:{door}:admitted_{op.kind}s"] += 1
                self.first_at = now if self.first_at is None else self.first_at
                self.last_at = now
                return None
            self.stats["refused"] += 1
            self.stats[f"refused:{refusal.reason}"] += 1
            self.stats[f"status:{refusal.status}"] += 1
            self.stats[f"door:{door}:refused"] += 1
            return refusal

    def finished(self, op: Op, status: int, location: str | None = None, method: str = "") -> None:
        """The emulator answered ``status`` to an admitted ``op`` (``location``: the upload URL a resumable
        upload's start answers with): a completed write of its name is recorded."""
        with self._lock:
            now = self.clock()
            self.last_at = now
            if location and op.name is not None and not op.completes:
                upload_id = parse_qs(urlsplit(location).query).get("upload_id", [None])[0]
                if upload_id is not None:
                    self.uploads[upload_id] = op.name
            if op.kind == "write" and op.completes and op.name is not None and status in (200, 201, 204):
                self.objects.written(op.name, now, deleted=method == "DELETE")
                if op.upload_id is not None:
                    self.uploads.pop(op.upload_id, None)

    def count(self, key: str) -> None:
        with self._lock:
            self.stats[key] += 1

    def snapshot(self) -> dict[str, Any]:
        """The counts as JSON: ``stats``, objects written, the names written twice within the interval."""
        with self._lock:
            return {"stats": dict(self.stats), "objects_written": sum(self.objects.counts.values()),
                    "names_written": len(self.objects.counts),
                    "most_writes_of_one_name": max(self.objects.counts.values(), default=0),
                    "twice": [list(t) for t in self.objects.twice[:50]], "twice_count": len(self.objects.twice),
                    "first_at": self.first_at, "last_at": self.last_at}

    def reset(self) -> None:
        """Forget the counts (the limits' state stays: the bucket has not forgotten its load)."""
        with self._lock:
            self.stats.clear()
            self.log = [] if self.log is not None else None
            self.objects = ObjectWrites(self.limits.object_write_interval_s)
            self.first_at = self.last_at = None


def gcs_error(refusal: Refusal) -> bytes:
    """The body GCS answers a refusal with (its JSON API's error form)."""
    reason = "rateLimitExceeded" if refusal.status == 429 else "backendError"
    message = {"object_rate": "The object exceeded the rate limit for object mutation operations "
                              "(create, update, and delete). Please reduce your request rate.",
               "write_rate": "The bucket's write request rate is over its current capacity. Please back off.",
               "read_rate": "The bucket's read request rate is over its current capacity. Please back off."}
    text = message.get(refusal.reason, "Please back off.")
    return json.dumps({"error": {"code": refusal.status, "message": text,
                                 "errors": [{"reason": reason, "message": text}]}}).encode()


__all__ = ["BucketRules", "Clock", "Limits", "ManualClock", "ObjectWrites", "Op", "RampingRate", "Refusal",
           "TokenBucket", "body_name", "classify", "gcs_error"]
