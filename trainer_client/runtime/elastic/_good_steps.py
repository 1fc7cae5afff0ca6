"""Which steps of an Orbax directory are good: ckptd's answer when it answers, the same rule from storage when not.

``trainer_client.CheckpointManager`` names only good steps (docs/adopt.md, "Plain Orbax"): a step is good when
it is committed by the commit rule (``commit_success.txt``, a final name, Orbax metadata that parses:
``trainer_client.core.format._steps``), not quarantined, and its files match its manifest (quick validation;
a step without a manifest, written by plain Orbax, is taken on the commit rule alone, as ckptd would adopt it).
With a ckptd client, the steps ckptd verified are good, those it quarantined or found corrupt are not, and
the steps it has not judged yet (saved since its last scan, or not verified yet) are judged here by the same
rule from storage (``trainer_client.core._validation.latest_good_on_storage``); with no client, or when ckptd
does not answer, every step is judged from storage.

``GoodStepsOnly`` hands Orbax's own manager the same view: its step listing leaves out what is not good, so
its ``should_save`` and save decisions never count a step ckptd's rule refuses. No jax here; Orbax's path
types only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from etils import epath

from trainer_client.client._ckptd_client import CkptdClient
from trainer_client.core import protocol as p
from trainer_client.core._refusals import refusal_kind
from trainer_client.core._storage import Storage
from trainer_client.core._validation import latest_good_on_storage
from trainer_client.core.format._steps import step_entries
from trainer_client.errors import CkptdRequestError, CkptdUnavailable

_log = logging.getLogger(__name__)

_T = TypeVar("_T")
_REFUSED = frozenset({p.StepState.QUARANTINED, p.StepState.CORRUPT})


def split_directory(directory: str) -> tuple[str, str]:
    """``(root, job)`` of a manager's directory: the job is the directory's last name, the root what holds it
    (MaxText's ``<base>/<run>/checkpoints`` is the job ``checkpoints`` under the root ``<base>/<run>``)."""
    trimmed = directory.rstrip("/")
    root, sep, job = trimmed.rpartition("/")
    if not sep or not job:
        raise ValueError(f"{directory!r}: a checkpoint directory needs a parent (the root ckptd serves)")
    if not root or root.endswith(":/"):  # "/ckpt" or "gs://bucket": the root is "/" or the bucket
        root += "/"
    return root, job


class GoodSteps:
    """The good steps of one job directory, asked of ckptd (``client``) or judged from storage."""

    def __init__(self, directory: str, client: CkptdClient | None = None) -> None:
        root, self.job = split_directory(directory)
        self.storage = Storage(root)
        self.job_path = self.storage.join(self.job)
        self.client = client
        self.renewed: set[int] = set()  # steps saved anew after what held their number was moved aside

    def renew(self, step: int) -> None:
        """``step`` is a new directory (what held the number was moved aside): ckptd's verdict on the old one
        no longer counts; this manager judges it from storage from now on."""
        self.renewed.add(step)

    def latest(self) -> int | None:
        """The newest good step: ckptd's latest-good (confirmed on storage by ckptd before it answers), or a
        newer step ckptd has not judged yet that passes the rule here; from storage alone without ckptd."""
        confirmed = self._ckptd_latest()
        if confirmed is None:
            found = latest_good_on_storage(self.storage, self.job_path)
            return None if found is None else found.step
        base = confirmed[0]
        newer = [s for s in self._names() if base is None or s > base]
        judged = self._judge(newer)
        return max(judged, default=base)

    def all(self) -> list[int]:
        """Every good step, oldest first."""
        listing = self._ckptd_listing()
        names = self._names()
        if listing is None:
            return sorted(self._judge(names))
        verified = {s for s, state in listing.items() if state is p.StepState.VERIFIED and s not in self.renewed}
        unjudged = [s for s in names if s not in verified and (s in self.renewed or listing.get(s) not in _REFUSED)]
        return sorted(verified.intersection(names) | self._judge(unjudged))

    def _names(self) -> list[int]:
        """The steps on storage under a final name (a tmp directory is never a step), newest first."""
        self.storage.invalidate(self.job_path)
        if not self.storage.exists(self.job_path):
            return []
        return sorted({parsed.step for parsed, _ in step_entries(self.storage, self.job_path) if not parsed.is_tmp},
                      reverse=True)

    def _judge(self, steps: Iterable[int]) -> set[int]:
        """Which of ``steps`` pass the rule on storage: each newest-first question names the newest good step
        at or below it, so every step above that answer is judged bad without another look."""
        pending = sorted(set(steps), reverse=True)
        good: set[int] = set()
        i = 0
        while i < len(pending):
            found = latest_good_on_storage(self.storage, self.job_path, at_most=pending[i])
            if found is None:
                break
            if found.step in pending:
                good.add(found.step)
            while i < len(pending) and pending[i] >= found.step:
                i += 1
        return good

    def _ckptd_latest(self) -> tuple[int | None] | None:
        """``(step,)`` as ckptd answers latest-good (``(None,)``: it has none), or None when it cannot answer."""
        answer = self._ask(lambda client: client.latest_good(self.job))
        return None if answer is None else (None if answer[0] is None else answer[0].step,)

    def _ckptd_listing(self) -> dict[int, p.StepState] | None:
        """Every step ckptd knows of the job and its state, or None when it cannot answer."""
        answer = self._ask(self._listing)
        return None if answer is None else answer[0]

    def _listing(self, client: CkptdClient) -> dict[int, p.StepState]:
        try:
            listing = client.checkpoints(self.job)
        except CkptdRequestError as exc:
            if not refusal_kind(exc.code).nothing_to_resume:  # no such job: no step (trainer_client/core/_refusals.py)
                raise
            return {}
        return {info.step: info.state for info in listing.checkpoints}

    def _ask(self, question: Callable[[CkptdClient], _T]) -> tuple[_T] | None:
        """``(ckptd's answer,)``, or None without a client or when ckptd does not answer."""
        if self.client is None:
            return None
        try:
            return (question(self.client),)
        except CkptdUnavailable as exc:
            _log.info("ckptd did not answer (%s): judging %s from storage", exc, self.job_path)
            return None


class GoodStepsOnly:
    """An Orbax step name format that lists only good steps (``good()``); names and finds steps as ``inner``."""

    def __init__(self, inner: Any, good: Callable[[], Iterable[int]]) -> None:
        self._inner = inner
        self._good = good

    def build_name(self, step: int) -> str:
        return str(self._inner.build_name(step))

    def find_all(self, base_path: epath.PathLike) -> Iterator[Any]:
        good = set(self._good())
        return (meta for meta in self._inner.find_all(base_path) if meta.step in good)

    def find_step(self, base_path: epath.PathLike, step: int) -> Any:
        return self._inner.find_step(base_path, step)

    def __getattr__(self, name: str) -> Any:  # the rest of Orbax's name format (e.g. single_host_load_and_broadcast)
        return getattr(self._inner, name)


__all__ = ["GoodSteps", "GoodStepsOnly", "split_directory"]
