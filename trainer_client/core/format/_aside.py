"""Steps moved aside: what a save found under the number it takes, kept under another name (docs/adopt.md,
"A save over a bad step").

When a writer saves a step whose number is held by a step that is not good — quarantined, found corrupt, or
uncommitted (a save cut short) — it moves that step to ``<step>.ckptd-aside-<UTC time>[-<n>]`` beside the steps
before writing, so the evidence is kept, never replaced (the runtime's ``trainer_client.runtime.saving._step_aside``).
Such a name is never a step to Orbax (its step names are ``[<prefix>_]<digits>``, its temporary ones carry
``.orbax-checkpoint-tmp``, which its cleanup deletes) nor to ckptd's commit rule (``_steps.parse_step_name``):
neither serves, counts, retains nor cleans it. ``ckptd ls`` counts a job's moved-aside steps and ``ckptd show``
lists them with what they were (``aside_state``). No jax here.
"""

from __future__ import annotations

import re
import time
from collections.abc import Container
from dataclasses import dataclass

from trainer_client.core._storage import Storage, join_path
from trainer_client.core._validation import read_quarantine
from trainer_client.core.format._files import COMMIT_MARKER

ASIDE_MARK = ".ckptd-aside-"
# <step>.ckptd-aside-<YYYYmmddTHHMMSSZ>[-<n>]: no underscore (Orbax's prefixed step names end in _<digits>)
_ASIDE_NAME = re.compile(r"^(?P<step>\d{1,19})\.ckptd-aside-(?P<when>\d{8}T\d{6}Z)(?:-(?P<n>\d{1,4}))?$")


@dataclass(frozen=True)
class AsideStep:
    """A step moved aside: its number, its directory's name and path, and when it was moved (UTC, from its name)."""

    step: int
    name: str
    path: str
    moved_at: str


def aside_name(step: int, taken: Container[str], now: float | None = None) -> str:
    """The name step ``step`` is moved aside under, one that is not in ``taken`` (the job directory's names)."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time() if now is None else now))
    name = f"{step}{ASIDE_MARK}{stamp}"
    n = 1
    while name in taken:
        name = f"{step}{ASIDE_MARK}{stamp}-{n}"
        n += 1
    return name


def parse_aside_name(name: str) -> tuple[int, str] | None:
    """``(step, UTC time)`` of a moved-aside name, or None for any other name."""
    m = _ASIDE_NAME.fullmatch(name)
    return None if m is None else (int(m.group("step")), m.group("when"))


def aside_steps(storage: Storage, job_path: str) -> list[AsideStep]:
    """The moved-aside steps of a job directory, by step then time."""
    found = []
    for entry in storage.list_dir(job_path):
        parsed = parse_aside_name(entry.name)
        if parsed is not None and entry.is_dir:
            found.append(AsideStep(parsed[0], entry.name, entry.path, parsed[1]))
    return sorted(found, key=lambda a: (a.step, a.name))


def aside_state(storage: Storage, path: str) -> str:
    """What a moved-aside step was: ``quarantined: <reason>``, ``uncommitted`` (no commit marker) or
    ``committed, not good`` (found corrupt)."""
    record = read_quarantine(storage, path)
    if record is not None:
        return f"quarantined: {record.get('reason', 'no reason recorded')}"
    if not storage.exists(join_path(path, COMMIT_MARKER)):
        return "uncommitted"
    return "committed, not good"


__all__ = ["ASIDE_MARK", "AsideStep", "aside_name", "aside_state", "aside_steps", "parse_aside_name"]
