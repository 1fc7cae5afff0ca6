"""The first contact of a ``ckptd`` command with its storage: bounded in time, and said in one line when it fails.

Left to itself, a request retries for half a minute (gcsfs's back-off, or ckptd's in its place:
``trainer_client/core/_gcs_pacing.py``), and ends in tracebacks and a misleading "is not a directory"
(docs/operations.md, the storage-errors table). Here the root is probed on a thread
of its own while the command waits at most ``CKPTD_STORAGE_TIMEOUT_S`` (``ckptd.config.CliSettings``), showing on a
terminal how long it has waited and the last error retried; then it stops with one line naming the cause
(``trainer_client.core._storage_causes``: credentials, network, a missing bucket), exit 1. The storage backends'
own log records (gcsfs logs every retry, its tracebacks included) are kept from the terminal and only their last
message is used, as the cause.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from dataclasses import dataclass

import fsspec
from tqdm import tqdm

from trainer_client.core import Storage, StorageError, failure_cause

BACKEND_LOGGERS = ("gcsfs", "fsspec", "google", "aiohttp")  # what storage libraries log through
_PREFIXES = ("retrying after exception:", "out of retries on exception:", "non-retriable exception:")
MAX_CAUSE_CHARS = 160  # of a library's message, quoted in the one line


class Unreachable(StorageError):
    """The root did not answer, or answered that it is not there: ``str()`` is the one line to print."""


def _clip(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_CAUSE_CHARS else text[: MAX_CAUSE_CHARS - 3] + "..."


class _LastMessage(logging.Handler):
    """Keeps the last trouble the storage libraries logged: a warning (google-auth: "Compute Engine Metadata server
    unavailable") or a retried error (gcsfs at DEBUG: "retrying after exception: ...")."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.last: str | None = None
        self.last_from = ""  # the logger that said it

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
        except Exception:  # a malformed record of a library: nothing to say
            return
        for prefix in _PREFIXES:
            if prefix in text:
                self.last, self.last_from = _clip(text.split(prefix, 1)[1]), record.name
                return
        if record.levelno >= logging.WARNING:
            self.last, self.last_from = _clip(text), record.name


_HANDLER = _LastMessage()


def quiet_backends() -> _LastMessage:
    """From now on the storage libraries' log records go to one handler that keeps the last retried error, not to
    stderr (idempotent)."""
    for name in BACKEND_LOGGERS:
        logger = logging.getLogger(name)
        if _HANDLER not in logger.handlers:
            logger.addHandler(_HANDLER)
        logger.propagate = False
        if name == "gcsfs":
            logger.setLevel(logging.DEBUG)  # its retries are logged at DEBUG: the cause of a wait that times out
    return _HANDLER


@dataclass
class _Probe:
    storage: Storage | None = None
    is_dir: bool = False
    exists: bool = False
    bucket_missing: bool = False
    error: BaseException | None = None


def _probe(url: str, out: _Probe) -> None:
    try:  # opening gs:// may look for credentials (google-auth asks the metadata server): inside the bound too
        storage = out.storage = Storage(url)
        out.is_dir = storage.is_dir(storage.root)
        if not out.is_dir:
            out.exists = storage.exists(storage.root)
            if not out.exists and storage.is_remote:
                out.bucket_missing = not storage.is_dir(storage.root.split("/", 1)[0])
    except BaseException as exc:  # reported by the waiting thread
        out.error = exc


def _cause(exc: BaseException) -> str:
    """``StorageError`` says what failed and why; its cause alone is the backend's story."""
    return failure_cause(exc.__cause__ if isinstance(exc, StorageError) and exc.__cause__ else exc)


def reach(url: str, shown_as: str, timeout_s: float) -> Storage:
    """The storage of the root ``url`` (given as ``shown_as``), once it has answered that the root is a directory,
    within ``timeout_s``. ``Unreachable`` (``str()``: one line) when it does not answer in time, cannot be read
    (credentials, network), has no such bucket, or holds nothing or a file there. On a terminal the wait shows
    after a second (stderr)."""
    handler = quiet_backends()
    handler.last, handler.last_from = None, ""
    if "://" in url:  # the backend's library (gcsfs) is imported before the clock starts: no storage in that
        fsspec.get_filesystem_class(url.split("://", 1)[0])
    out = _Probe()
    worker = threading.Thread(target=_probe, args=(url, out), name="ckptd-first-contact", daemon=True)
    started = time.monotonic()
    worker.start()
    with tqdm(total=round(timeout_s, 1), desc=f"waiting for {shown_as}", unit="s", file=sys.stderr, disable=None,
              delay=1.0, leave=False, bar_format="{desc}: {n:.0f}/{total:.0f} s{postfix}") as bar:
        shown = 0.0
        while worker.is_alive() and (waited := time.monotonic() - started) < timeout_s:
            worker.join(min(0.25, max(0.0, timeout_s - waited)))
            if handler.last:
                bar.set_postfix_str(f"retrying: {handler.last[:80]}", refresh=False)
            now = min(time.monotonic() - started, timeout_s)
            bar.update(now - shown)  # tqdm shows it past its delay, and clears it at the end
            shown = now
    if worker.is_alive():  # left behind, a daemon: the command ends now
        last = f"; last error: {failure_cause(handler.last)}" if handler.last else ""
        if out.storage is None and handler.last_from.startswith("google.auth"):  # still looking for credentials
            last = ("; credentials: none found yet (set GOOGLE_APPLICATION_CREDENTIALS or run `gcloud auth "
                    f"application-default login`){': ' + handler.last if handler.last else ''}")
        raise Unreachable(f"{shown_as}: storage did not answer within {timeout_s:g} s{last} (CKPTD_STORAGE_TIMEOUT_S "
                          "sets the wait)")
    if out.error is not None:
        raise Unreachable(f"{shown_as}: {_clip(_cause(out.error))}")
    if out.bucket_missing:
        bucket = url.split("://", 1)[-1].split("/", 1)[0]
        raise Unreachable(f"{shown_as}: no bucket {bucket!r} (or these credentials may not see it)")
    if out.storage is None or not out.is_dir:
        raise Unreachable(f"{shown_as} is not a directory" if out.exists else f"{shown_as} does not exist")
    return out.storage


__all__ = ["BACKEND_LOGGERS", "Unreachable", "quiet_backends", "reach"]
