"""The files one host's part of a multi-process step wrote, with their sizes and CRC32Cs: what its part record lists
and the leader's manifest takes as they are (docs/multihost.md, section 5), jax-free.

On a local root each file is found and read back to be checksummed. On an object store the store's own CRC32C is
taken, as a whole step's manifest takes it (docs/gcs.md, "Integrity on GCS"): one listing of the part's OCDBT
directory and one metadata read of each other file the part wrote, nothing read back; so a host's part costs the
bucket the same few reads whatever its size (docs/gcs.md, "Many hosts on one bucket").
"""

from __future__ import annotations

import posixpath

from trainer_client.core._storage import Storage, join_path, storage_errors
from trainer_client.core.format._files import ARRAY_METADATAS, ITER_ITEM, OCDBT_PROCESS_PREFIX, STRINGS_FILE
from trainer_client.core.format._manifest import file_entry
from trainer_client.core.format._parts import PartFile
from trainer_client.core.format._step_files import Listed, list_files


def part_files(storage: Storage, step_path: str, item: str, process_index: int, process_count: int, *,
               wrote_iter: bool | None = None, wrote_strings: bool | None = None) -> list[PartFile]:
    """Every file host ``process_index``'s part wrote under ``step_path``, with size and CRC32C. ``wrote_iter``,
    ``wrote_strings``: whether the part wrote the data iterator's file and (process 0) ``_strings.json``; None:
    look for them."""
    ocdbt = f"{item}/{OCDBT_PROCESS_PREFIX}{process_index}"
    singles = [f"{item}/{ARRAY_METADATAS}/process_{process_index}"]
    if wrote_iter is not False:
        singles.append(f"{ITER_ITEM}/process_{process_index}-of-{process_count}.json")
    if process_index == 0 and wrote_strings is not False:
        singles.append(f"{item}/{STRINGS_FILE}")
    if not storage.is_remote:
        return _read_back(storage, step_path, [ocdbt, *singles])
    listed = _listed(storage, step_path, ocdbt)
    for rel in singles:
        path = join_path(step_path, rel)
        storage.invalidate(posixpath.dirname(path))  # what the store holds now, not a listing cached before
        try:
            with storage_errors(f"cannot stat {storage.url_of(path)}"):
                info = storage.fs.info(path)
        except FileNotFoundError:
            continue
        if info.get("type") == "directory":
            listed.update(_listed(storage, step_path, rel))
        else:
            crc = info.get("crc32c")
            listed[rel] = Listed(int(info.get("size") or 0), str(crc) if crc else None)
    out = []
    for rel, found in sorted(listed.items()):
        if found.crc32c is None:  # a store that keeps no CRC32C: read back
            entry = file_entry(storage, join_path(step_path, rel))
            out.append(PartFile(path=rel, size=entry.size, crc32c=entry.crc32c))
        else:
            out.append(PartFile(path=rel, size=found.size, crc32c=found.crc32c))
    return out


def _listed(storage: Storage, step_path: str, rel_dir: str) -> dict[str, Listed]:
    """The files under ``<step_path>/<rel_dir>`` by one listing, relative to ``step_path``."""
    return {f"{rel_dir}/{rel}": found for rel, found in list_files(storage, join_path(step_path, rel_dir)).items()}


def _read_back(storage: Storage, step_path: str, roots: list[str]) -> list[PartFile]:
    """``part_files`` on a local root: each root found (a directory's files, or the file), read back."""
    rels: list[str] = []
    for rel in roots:
        path = join_path(step_path, rel)
        if storage.is_dir(path):
            rels.extend(posixpath.relpath(found, step_path.rstrip("/")) for found in storage.fs.find(path))
        elif storage.exists(path):
            rels.append(rel)
    out = []
    for rel in sorted(rels):
        entry = file_entry(storage, join_path(step_path, rel))
        out.append(PartFile(path=rel, size=entry.size, crc32c=entry.crc32c))
    return out


__all__ = ["part_files"]
