"""``ckptd gc`` and the steps a save moved aside (docs/operations.md, "Steps moved aside").

Before the drop-in manager saves a step whose number is held by a step that is not good — quarantined, found
corrupt, or a save cut short — it moves that step to ``<step>.ckptd-aside-<UTC time>`` (``trainer_client/runtime/
saving/_step_aside.py``): the evidence of what went wrong, kept. No retention rule deletes one, and ckptd never deletes
one on its own. ``gc`` lists each (what it was, when it was moved: the time in its name) and deletes one only
when told to with ``--delete-aside-older-than DURATION`` and it was moved longer ago than that; never in a
read-only job. Its records on the side prefix (a read-only ckptd's, moved with it) go with it.
"""

from __future__ import annotations

import calendar
import time
from dataclasses import dataclass
from typing import Any, Literal

from trainer_client.core import Storage, storage_errors
from trainer_client.core.format import AsideStep, aside_state, aside_steps, side_dir

STATE = "moved_aside"  # what a moved-aside step's row says in the STATE column and in --json
OPTION = "--delete-aside-older-than"


@dataclass(frozen=True)
class AsideDecision:
    """What ``gc`` does with one moved-aside step, and why."""

    aside: AsideStep
    was: str  # what it was when moved (``aside_state``)
    age_s: float | None  # since it was moved (None: its name's time does not parse)
    action: Literal["keep", "delete"]
    reason: str

    def as_json(self) -> dict[str, Any]:
        return {"step": self.aside.step, "path": self.aside.path, "state": STATE, "action": self.action,
                "reasons": [self.reason], "was": self.was, "moved_at": self.aside.moved_at, "age_s": self.age_s}


def _moved_s(stamp: str) -> float | None:
    try:
        return float(calendar.timegm(time.strptime(stamp, "%Y%m%dT%H%M%SZ")))
    except ValueError:
        return None


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= 2 * size:
            return f"{seconds / size:.0f}{unit}"
    return f"{max(seconds, 0.0):.0f}s"


def decide_aside(storage: Storage, job_path: str, *, older_than_s: float | None, read_only: bool,
                 now: float | None = None) -> list[AsideDecision]:
    """What to do with each moved-aside step of the job at ``job_path``: delete those moved longer ago than
    ``older_than_s`` (None: keep every one), never in a ``read_only`` job."""
    now = time.time() if now is None else now
    out = []
    action: Literal["keep", "delete"]
    for aside in aside_steps(storage, job_path):
        moved = _moved_s(aside.moved_at)
        age = None if moved is None else now - moved
        was = aside_state(storage, aside.path)
        kept = f"moved aside {_age(age)} ago" if age is not None else "moved aside"
        if read_only:
            action, reason = "keep", "read-only job: ckptd deletes nothing here"
        elif older_than_s is None:
            action, reason = "keep", f"{kept}: kept as evidence; {OPTION} DURATION deletes it once older"
        elif age is None or age < older_than_s:
            action, reason = "keep", f"{kept}, less than {_age(older_than_s)} ago"
        else:
            action, reason = "delete", f"{kept}, more than {_age(older_than_s)} ago ({OPTION})"
        out.append(AsideDecision(aside, was, age, action, reason))
    return out


def delete_aside(storage: Storage, decisions: list[AsideDecision], *, dry_run: bool) -> list[AsideDecision]:
    """Delete the moved-aside steps ``decide_aside`` said to delete, with their side records (unless ``dry_run``);
    the decisions carried out."""
    done = []
    for d in decisions:
        if d.action != "delete":
            continue
        if not dry_run:
            side = side_dir(d.aside.path)
            with storage_errors(f"cannot delete {storage.url_of(d.aside.path)}"):
                storage.remove(d.aside.path, recursive=True)
                storage.invalidate(side)
                if storage.is_dir(side):
                    storage.remove(side, recursive=True)
        done.append(d)
    if done and not dry_run:
        storage.invalidate()
    return done


__all__ = ["OPTION", "STATE", "AsideDecision", "decide_aside", "delete_aside"]
