"""The jax-free core that the sidecar and the trainer both import.

Everything the two sides must agree on lives here and nowhere else: the wire contract
(``core.protocol``), the stored format (``core.format``: step naming and the commit rule, manifests and
verified records, the OCDBT/zarr index, the host-memory snapshot format, the file names of all of them),
the resume planner (``core.planner``, ``core.batching``), the checkpoint period model (``core.planning``: the
advisor's first-order periods and the runner's autopilot), validation (``core.validation``) and storage
access (``core.storage``). Nothing under this package imports jax, orbax, the server framework or the
rest of ``trainer_client``; tensorstore is imported only inside the functions that read zarr metadata.
See docs/architecture.md for the package map.

Its public face: the names below, what ckptd (and any other package) imports from the core; the modules that
define them are private, imported on first use of a name (``_faces``), so importing one module of the core
loads no other. The public subpackages (``protocol``, ``planning``, ``format``) are faces of their own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainer_client.core._faces import exported, lazy_face

if TYPE_CHECKING:  # the real types for type checkers (``X as X``: re-exported); at run time, on first use
    from trainer_client.core._ckptd_url import UDS_BASE_URL as UDS_BASE_URL
    from trainer_client.core._ckptd_url import socket_path_problem as socket_path_problem
    from trainer_client.core._ckptd_url import unix_url as unix_url
    from trainer_client.core._durability import sync_paths as sync_paths
    from trainer_client.core._errors import ArrayIndexError as ArrayIndexError
    from trainer_client.core._errors import CkptdError as CkptdError
    from trainer_client.core._errors import MissingExtra as MissingExtra
    from trainer_client.core._errors import PlanningError as PlanningError
    from trainer_client.core._errors import StorageError as StorageError
    from trainer_client.core._errors import StoredFormatError as StoredFormatError
    from trainer_client.core._errors import UnsafePathError as UnsafePathError
    from trainer_client.core._extras import needs_extra as needs_extra
    from trainer_client.core._gcs_pacing import BUCKET_WRITES_PER_S as BUCKET_WRITES_PER_S
    from trainer_client.core._gcs_pacing import WriteShare as WriteShare
    from trainer_client.core._generations import ListedGenerations as ListedGenerations
    from trainer_client.core._generations import delete_as_listed as delete_as_listed
    from trainer_client.core._generations import listed_generations as listed_generations
    from trainer_client.core._identity import step_identity as step_identity
    from trainer_client.core._planner import format_bytes as format_bytes
    from trainer_client.core._refusals import refusal_kind as refusal_kind
    from trainer_client.core._refusals import refusal_message as refusal_message
    from trainer_client.core._resume_candidates import resume_candidates as resume_candidates
    from trainer_client.core._resume_decision import Refusal as Refusal
    from trainer_client.core._resume_decision import decide as decide
    from trainer_client.core._said_once import SaidOnce as SaidOnce
    from trainer_client.core._step_plan import plan_for_step as plan_for_step
    from trainer_client.core._storage import Entry as Entry
    from trainer_client.core._storage import Storage as Storage
    from trainer_client.core._storage import join_path as join_path
    from trainer_client.core._storage import mtime_of as mtime_of
    from trainer_client.core._storage import storage_errors as storage_errors
    from trainer_client.core._storage import storage_failures as storage_failures
    from trainer_client.core._storage_causes import failure_cause as failure_cause
    from trainer_client.core._validation import Level as Level
    from trainer_client.core._validation import ValidationResult as ValidationResult
    from trainer_client.core._validation import extent_problems as extent_problems
    from trainer_client.core._validation import parse_quarantine as parse_quarantine
    from trainer_client.core._validation import read_quarantine as read_quarantine
    from trainer_client.core._validation import validate_step as validate_step
    from trainer_client.core._whole_files import write_json_file as write_json_file

_EXPORTS = {
    "trainer_client.core._ckptd_url": ("UDS_BASE_URL", "socket_path_problem", "unix_url"),
    "trainer_client.core._durability": ("sync_paths",),
    "trainer_client.core._errors": ("ArrayIndexError", "CkptdError", "MissingExtra", "PlanningError", "StorageError",
                                    "StoredFormatError", "UnsafePathError"),
    "trainer_client.core._extras": ("needs_extra",),
    "trainer_client.core._gcs_pacing": ("BUCKET_WRITES_PER_S", "WriteShare"),
    "trainer_client.core._generations": ("ListedGenerations", "delete_as_listed", "listed_generations"),
    "trainer_client.core._identity": ("step_identity",),
    "trainer_client.core._planner": ("format_bytes",),
    "trainer_client.core._refusals": ("refusal_kind", "refusal_message"),
    "trainer_client.core._resume_candidates": ("resume_candidates",),
    "trainer_client.core._resume_decision": ("Refusal", "decide"),
    "trainer_client.core._said_once": ("SaidOnce",),
    "trainer_client.core._step_plan": ("plan_for_step",),
    "trainer_client.core._storage": ("Entry", "Storage", "join_path", "mtime_of", "storage_errors",
                                     "storage_failures"),
    "trainer_client.core._storage_causes": ("failure_cause",),
    "trainer_client.core._validation": ("Level", "ValidationResult", "extent_problems", "parse_quarantine",
                                        "read_quarantine", "validate_step"),
    "trainer_client.core._whole_files": ("write_json_file",),
}

__all__ = exported(_EXPORTS)

if not TYPE_CHECKING:
    __getattr__, __dir__ = lazy_face(__name__, _EXPORTS)
