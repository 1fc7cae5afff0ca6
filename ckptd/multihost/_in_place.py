"""What the parties of a multi-host save delete where its parts are written in place (``gs://``), only as they
listed it (docs/gcs.md, "Fencing on gs://").

On ``gs://`` a save's parts go straight to ``<job>/<step>/``, and the step number passes from a dead incarnation's
save to the restarted one's (a takeover) or, once abandoned, to whichever save claims it next. Two deletions there
could take what came after them: a cleanup whose decider paused past the save timeout (the next leader redid it,
and a new save of the step was committed since), and the removal of a dead save's part record that landed after
the takeover (it would keep the new save's record out for good). Both delete only the objects they listed, each
while it holds its listed generation (``trainer_client.core``'s ``delete_as_listed``); ``PartSaves`` calls them.
"""

from __future__ import annotations

import logging

from trainer_client.core import ListedGenerations, Storage, delete_as_listed, listed_generations
from trainer_client.core.format import SnapshotMeta, read_fate, read_part, record_path, report_refused

_log = logging.getLogger(__name__)


def delete_listed(storage: Storage, listed: list[tuple[str, ListedGenerations]]) -> str | None:
    """Delete each prefix's listed objects in turn (an abandoned save's in-place files, then its claim), each only
    as listed; None when all went, else why it stopped (nothing more deleted)."""
    for prefix, objects in listed:
        done = delete_as_listed(storage, prefix, objects)
        if done.refused is not None:
            return done.refused
    return None


def record_standing(storage: Storage, job: str, meta: SnapshotMeta, where: str) -> str | None:
    """What stands at this part's record in ``where``: None when nothing (or an unreadable record: rewritten), or
    once a record of a retired save was deleted (it can never be committed; on ``gs://`` a dead incarnation's
    sidecar still writing may land it just after the takeover's check); "written" when it is this save's; else why
    this part is not written now (another save's record, reported)."""
    path = record_path(where, meta.process_index)
    found = read_part(storage, where, meta.process_index)
    if found is None or found.save_id == meta.save_id:
        return None if found is None else "written"
    if storage.is_remote and read_fate(storage, job, meta.step, found.save_id) == "retire":
        listed = listed_generations(storage, path)  # then read again: the record of that generation
        again = read_part(storage, where, meta.process_index)
        if listed and again is not None and again.save_id == found.save_id and (
                delete_as_listed(storage, path, listed).refused is None):
            _log.warning("step %s of %s: removed the part record of save %s (retired; it landed after save %s took "
                         "the step over)", meta.step, job, found.save_id, meta.save_id)
            return None
    report_refused(path, f"a part record of save {found.save_id} where save {meta.save_id}'s goes")
    return "part record of another save in place"


__all__ = ["delete_listed", "record_standing"]
