"""Reading a small object whole from an object store in as few requests as its size allows: ``Storage.read_bytes``
on ``gs://`` (docs/gcs.md, "Many hosts on one bucket").

ckptd's reads of objects are of records and metadata of a few KiB, and many are asked to learn that one is not there
(a part record before it is written, a save's fate). One ranged read of the first 64 KiB answers both: the object
whole, or 404. gcsfs's ``info`` costs two requests (the object's metadata and a listing, to tell a "directory"),
and the read a third. Only an object of 64 KiB or more is then sized (``info``) and refused past its bound before
more of it is read: at most 64 KiB of an object past its bound is ever read, and at most ``max_bytes + 1`` bytes
of any. An empty object answers a range with 416: ``info`` then says it is empty. A prefix (a "directory") of the
name, with no object of it, is absent, as it is on GCS; one with an object of the name too is read as that object.
"""

from __future__ import annotations

from typing import Any

from trainer_client.core._errors import RecordTooLargeError, StoredFormatError

FIRST_READ_BYTES = 1 << 16


def too_large(name: str, size: int, max_bytes: int) -> RecordTooLargeError:
    return RecordTooLargeError(f"{name}: {size} bytes, more than the {max_bytes} such a file may have: not read")


def read_object(fs: Any, path: str, max_bytes: int, shown: str) -> bytes:
    """The bytes of the object ``path`` of the file system ``fs`` (``shown``: its URL, in errors), at most
    ``max_bytes`` of them (else ``RecordTooLargeError``); ``FileNotFoundError`` when there is none."""
    first = min(FIRST_READ_BYTES, max_bytes + 1)
    try:
        data: bytes | None = bytes(fs.cat_file(path, start=0, end=first))
    except FileNotFoundError:
        raise
    except Exception as exc:
        if getattr(exc, "code", None) != 416:  # an empty object's range is not satisfiable: sized below
            raise
        data = None
    if data is not None and len(data) < first:
        return data
    info = fs.info(path)
    size = info.get("size")
    if info.get("type") == "directory":
        raise StoredFormatError(f"{shown} is not a regular file")
    if isinstance(size, int | float) and size > max_bytes:
        raise too_large(shown, int(size), max_bytes)
    if size == 0:
        return b""
    data = bytes(fs.cat_file(path, start=0, end=max_bytes + 1))
    if len(data) > max_bytes:
        raise too_large(shown, len(data), max_bytes)
    return data


__all__ = ["FIRST_READ_BYTES", "read_object", "too_large"]
