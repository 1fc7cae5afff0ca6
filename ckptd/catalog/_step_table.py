"""The catalog's table: one SQLite row per step directory of each job, the queries answers make and the writes
scans make. The one module of the catalog that holds SQL.

A cache of storage (docs/architecture.md, invariant 1): dropped and rebuilt at every start, written only
by the catalog's scans (``ckptd/catalog/_catalog.py``) and ``ckptd validate`` (``mark``). ``version`` is bumped
after every write that changes a step's state or reason, or drops a step or a job, so answers cached per
version are never older than the rows they came from. A settled step's row keeps the identity of the content its
verdict is about, and its directory's time as last listed (``ckptd/catalog/_identity.py``).
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from ckptd.catalog._identity import Judged, Settledness
from trainer_client.core.format import training_summary
from trainer_client.core.protocol import MAX_STEP, CheckpointInfo, JobInfo, StepState, TrainingMetadata

# Verified and quarantined steps are settled: looked at once, and again only when their content changed (answers
# re-check the marker and the identity: ckptd/catalog/_identity.py). Corrupt and unverified ones are looked at again
# on every refresh (a directory copied in by a tool may show its marker before its metadata; a failed write of a
# manifest is retried).
FINAL_STATES = (StepState.VERIFIED.value, StepState.QUARANTINED.value)
# The others, named: ``state IN (...)`` searches the (job, state, step) index; ``NOT IN`` read every row of the job.
UNSETTLED_STATES = tuple(s.value for s in StepState if s.value not in FINAL_STATES)
GOOD = StepState.VERIFIED.value

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    name TEXT PRIMARY KEY,
    path TEXT NOT NULL,
    scanned_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS steps (
    job TEXT NOT NULL,
    dirname TEXT NOT NULL,
    step INTEGER NOT NULL,
    state TEXT NOT NULL,
    path TEXT NOT NULL,
    reason TEXT,
    committed_at REAL,
    training TEXT,
    identity TEXT,
    listed_mtime REAL,
    PRIMARY KEY (job, dirname)
);
CREATE INDEX IF NOT EXISTS steps_by_state ON steps (job, state, step);
"""


Row = tuple[str, str | None]  # a step's (state, reason) as catalogued


class StepTable:
    """The SQLite tables of jobs and steps, safe to use from several threads (one lock)."""

    def __init__(self, db_path: Path | str) -> None:
        # bumped after every write that changes a step's state or reason, or drops a step or a job: pollers skip
        # unchanged passes, and answers cached per version are never older than the rows they came from
        self.version = 0
        self._lock = threading.RLock()
        self._db = sqlite3.connect(str(db_path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=OFF")  # a cache: storage is the truth
        self._db.executescript(_SCHEMA)
        if "identity" not in {row[1] for row in self._db.execute("PRAGMA table_info(steps)")}:
            self.reset()  # a file an older ckptd left: rows without identities (every start scans again anyway)

    def reset(self) -> None:
        """Forget every job and step (a start scans storage again)."""
        with self._lock:
            self._db.executescript("DROP TABLE IF EXISTS steps; DROP TABLE IF EXISTS jobs;" + _SCHEMA)
        self.version += 1

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    # ---- what answers read --------------------------------------------------------------------

    def has_job(self, job: str) -> bool:
        with self._lock:
            return self._db.execute("SELECT 1 FROM jobs WHERE name = ?", (job,)).fetchone() is not None

    def jobs(self) -> list[JobInfo]:
        with self._lock:
            rows = self._db.execute(
                "SELECT j.name, j.path, COUNT(s.step), MAX(s.step), "
                "MAX(CASE WHEN s.state = ? THEN s.step END) "
                "FROM jobs j LEFT JOIN steps s ON s.job = j.name GROUP BY j.name ORDER BY j.name",
                (GOOD,),
            ).fetchall()
        return [
            JobInfo(name=r[0], path=r[1], steps=r[2], latest_step=r[3], latest_good_step=r[4]) for r in rows
        ]

    def checkpoints(self, job: str) -> list[CheckpointInfo]:
        with self._lock:
            rows = self._db.execute(
                "SELECT step, state, path, reason, committed_at, training FROM steps "
                "WHERE job = ? ORDER BY step, dirname",
                (job,),
            ).fetchall()
        return [_info(r) for r in rows]

    def states(self, job: str) -> dict[str, StepState]:
        """Step path -> state, for every catalogued step of ``job`` (no metadata parsed: cheap to poll)."""
        with self._lock:
            rows = self._db.execute("SELECT path, state FROM steps WHERE job = ?", (job,)).fetchall()
        return {str(path): StepState(str(state)) for path, state in rows}

    def at_path(self, job: str, path: str) -> CheckpointInfo | None:
        """The catalogued step stored at ``path``."""
        with self._lock:
            row = self._db.execute(
                "SELECT step, state, path, reason, committed_at, training FROM steps WHERE job = ? AND path = ?",
                (job, path),
            ).fetchone()
        return _info(row) if row else None

    def latest_good(self, job: str, at_most: int | None = None) -> CheckpointInfo | None:
        """The newest verified step (at or below ``at_most`` when given), as last catalogued."""
        return self.newest(job, StepState.VERIFIED, at_most)

    def newest(self, job: str, state: StepState, at_most: int | None = None) -> CheckpointInfo | None:
        """The newest step in ``state`` (at or below ``at_most`` when given), as last catalogued."""
        limit = at_most if at_most is not None else MAX_STEP
        with self._lock:
            row = self._db.execute(
                "SELECT step, state, path, reason, committed_at, training FROM steps "
                "WHERE job = ? AND state = ? AND step <= ? ORDER BY step DESC, dirname LIMIT 1",
                (job, state.value, limit),
            ).fetchone()
        return _info(row) if row else None

    def step(self, job: str, step: int) -> CheckpointInfo | None:
        """The catalogued directory of ``step`` (the committed one when several exist; of two named alike by
        Orbax's rules, ``100`` and ``checkpoint_100``, the first by name, as ``steps.step_entries`` orders them)."""
        with self._lock:
            row = self._db.execute(
                "SELECT step, state, path, reason, committed_at, training FROM steps "
                "WHERE job = ? AND step = ? ORDER BY state = ? DESC, dirname LIMIT 1",
                (job, step, GOOD),
            ).fetchone()
        return _info(row) if row else None



    def job_names(self) -> set[str]:
        with self._lock:
            return {str(name) for (name,) in self._db.execute("SELECT name FROM jobs")}

    def job_count(self) -> int:
        with self._lock:
            (count,) = self._db.execute("SELECT COUNT(*) FROM jobs").fetchone()
        return int(count)

    def scanned(self, job: str, *, unsettled_only: bool = False) -> dict[str, Row]:
        """Directory name -> (state, reason) of the job's catalogued steps (only those not settled yet: a job
        directory unchanged since its last listing needs no more, and a resume must not load 10,000 rows)."""
        with self._lock:
            if unsettled_only:
                marks = ", ".join("?" * len(UNSETTLED_STATES))
                rows = self._db.execute(f"SELECT dirname, state, reason FROM steps WHERE job = ? AND state IN "
                                        f"({marks})", (job, *UNSETTLED_STATES))
            else:
                rows = self._db.execute("SELECT dirname, state, reason FROM steps WHERE job = ?", (job,))
            return {str(row[0]): (str(row[1]), row[2]) for row in rows}

    def settledness(self, job: str) -> dict[str, Settledness]:
        """Directory name -> what the row of each settled step of ``job`` says of its verdict's content."""
        marks = ", ".join("?" * len(FINAL_STATES))
        with self._lock:
            rows = self._db.execute(f"SELECT dirname, state, identity, listed_mtime FROM steps WHERE job = ? AND "
                                    f"state IN ({marks})", (job, *FINAL_STATES)).fetchall()
        return {str(d): Settledness(str(s), i, float(m) if m is not None else None) for d, s, i, m in rows}

    def identity(self, job: str, path: str) -> str | None:
        """The identity of the content the verdict of the step stored at ``path`` is about (None: not known)."""
        with self._lock:
            row = self._db.execute("SELECT identity FROM steps WHERE job = ? AND path = ?", (job, path)).fetchone()
        return str(row[0]) if row and row[0] is not None else None

    # ---- what scans (and ckptd validate) write ------------------------------------------------------

    def keep_listed(self, job: str, listed: Mapping[str, float]) -> None:
        """Steps looked at again and found unchanged: their directories' times as listed now (no state changes)."""
        if listed:
            with self._tx() as db:
                db.executemany("UPDATE steps SET listed_mtime = ? WHERE job = ? AND dirname = ?",
                               [(mtime, job, dirname) for dirname, mtime in listed.items()])

    def keep_jobs(self, names: Iterable[str]) -> None:
        """Drop every job (and its steps) not in ``names``."""
        names = set(names)
        with self._tx() as db:
            dropped = [name for (name,) in db.execute("SELECT name FROM jobs").fetchall() if name not in names]
            for name in dropped:
                db.execute("DELETE FROM jobs WHERE name = ?", (name,))
                db.execute("DELETE FROM steps WHERE job = ?", (name,))
        if dropped:
            self.version += 1

    def drop_job(self, job: str) -> None:
        with self._tx() as db:
            dropped = db.execute("DELETE FROM jobs WHERE name = ?", (job,)).rowcount
            db.execute("DELETE FROM steps WHERE job = ?", (job,))
        if dropped:
            self.version += 1

    def record_scan(self, job: str, job_url: str, scanned_at: float, *, seen: Mapping[str, Row], gone: Iterable[str],
                    found: Iterable[tuple[str, Judged]], url_of: Callable[[str], str]) -> None:
        """One scan of ``job``: the steps ``gone`` from its directory leave, those ``found`` (directory name,
        inspection with its identity) are written; ``seen`` is what the scan started from (``scanned``), to tell a
        change."""
        gone, found = list(gone), list(found)
        with self._tx() as db:
            db.execute(
                "INSERT INTO jobs (name, path, scanned_at) VALUES (?, ?, ?) "
                "ON CONFLICT(name) DO UPDATE SET scanned_at = excluded.scanned_at",
                (job, job_url, scanned_at),
            )
            for dirname in gone:
                db.execute("DELETE FROM steps WHERE job = ? AND dirname = ?", (job, dirname))
            for dirname, judged in found:
                ins = judged.inspection
                db.execute(
                    "INSERT OR REPLACE INTO steps VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (job, dirname, ins.step, ins.state.value, url_of(ins.path), ins.reason, ins.committed_at,
                     _summary_json(judged), judged.identity, judged.listed_mtime),
                )
        # after the commit: a reader that sees the new version reads the new rows (answers are cached per version);
        # a settled step found again is a new save under its name: its metadata may differ whatever its state
        if gone or any(seen.get(dirname) != (j.inspection.state.value, j.inspection.reason)
                       or seen[dirname][0] in FINAL_STATES for dirname, j in found):
            self.version += 1

    def mark(self, job: str, step: int, state: StepState, reason: str | None) -> None:
        """Record what a validation outside the refresh found (``ckptd validate``)."""
        with self._tx() as db:
            db.execute("UPDATE steps SET state = ?, reason = ? WHERE job = ? AND step = ? AND state = ?",
                       (state.value, reason, job, step, GOOD))
        self.version += 1

    def record_step(self, job: str, dirname: str, judged: Judged | None) -> None:
        """One step inspected again: its new state and identity, or gone (``None``)."""
        with self._tx() as db:
            if judged is None:
                db.execute("DELETE FROM steps WHERE job = ? AND dirname = ?", (job, dirname))
            else:
                ins = judged.inspection
                db.execute(
                    "UPDATE steps SET state = ?, reason = ?, committed_at = ?, training = ?, identity = ?, "
                    "listed_mtime = ? WHERE job = ? AND dirname = ?",
                    (ins.state.value, ins.reason, ins.committed_at, _summary_json(judged), judged.identity,
                     judged.listed_mtime, job, dirname),
                )
        self.version += 1


def _summary_json(judged: Judged) -> str | None:
    """The training metadata a row keeps: without its per-array part (read from the step when a plan needs it)."""
    summary = training_summary(judged.inspection.training)
    return summary.model_dump_json() if summary is not None else None



def _info(row: tuple[object, ...]) -> CheckpointInfo:
    step, state, path, reason, committed_at, training = row
    return CheckpointInfo(
        step=int(step),  # type: ignore[call-overload]
        state=StepState(str(state)),
        path=str(path),
        reason=str(reason) if reason is not None else None,
        committed_at=float(committed_at) if committed_at is not None else None,  # type: ignore[arg-type]
        training=TrainingMetadata.model_validate_json(str(training)) if training else None,
    )


__all__ = ["FINAL_STATES", "GOOD", "UNSETTLED_STATES", "Row", "StepTable"]
