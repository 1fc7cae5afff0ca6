"""The on-storage and in-memory formats: what a step directory and a memory snapshot hold, and when
they may be trusted (the commit rule). Readers and writers on both sides use these modules, so a format
is defined once.

Its public face: the names below, what ckptd imports of the formats; the modules that define them are
private, imported on first use of a name (``trainer_client/core/_faces.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainer_client.core._faces import exported, lazy_face

if TYPE_CHECKING:  # the real types for type checkers (``X as X``: re-exported); at run time, on first use
    from trainer_client.core.format._array_index import decode_all_arrays as decode_all_arrays
    from trainer_client.core.format._aside import AsideStep as AsideStep
    from trainer_client.core.format._aside import aside_name as aside_name
    from trainer_client.core.format._aside import aside_state as aside_state
    from trainer_client.core.format._aside import aside_steps as aside_steps
    from trainer_client.core.format._fates import Fate as Fate
    from trainer_client.core.format._fates import decide_fate as decide_fate
    from trainer_client.core.format._fates import read_fate as read_fate
    from trainer_client.core.format._fates import read_fate_record as read_fate_record
    from trainer_client.core.format._files import CHECKPOINT_METADATA as CHECKPOINT_METADATA
    from trainer_client.core.format._files import CKPTD_MANIFEST as CKPTD_MANIFEST
    from trainer_client.core.format._files import CLAIMS_DIR as CLAIMS_DIR
    from trainer_client.core.format._files import COMMIT_MARKER as COMMIT_MARKER
    from trainer_client.core.format._files import EVENTS_DIR as EVENTS_DIR
    from trainer_client.core.format._files import EVENTS_SUMMARY_FILE as EVENTS_SUMMARY_FILE
    from trainer_client.core.format._files import JOB_LOCK as JOB_LOCK
    from trainer_client.core.format._files import LEASE_DIR as LEASE_DIR
    from trainer_client.core.format._files import PARTS_DIR as PARTS_DIR
    from trainer_client.core.format._files import QUARANTINE_FILE as QUARANTINE_FILE
    from trainer_client.core.format._files import SIDE_DIR as SIDE_DIR
    from trainer_client.core.format._files import SNAPSHOT_DATA_FILE as SNAPSHOT_DATA_FILE
    from trainer_client.core.format._files import SNAPSHOT_META_FILE as SNAPSHOT_META_FILE
    from trainer_client.core.format._files import VERIFIED_FILE as VERIFIED_FILE
    from trainer_client.core.format._manifest import UNMANIFESTED as UNMANIFESTED
    from trainer_client.core.format._manifest import FileEntry as FileEntry
    from trainer_client.core.format._manifest import Manifest as Manifest
    from trainer_client.core.format._manifest import build_manifest as build_manifest
    from trainer_client.core.format._manifest import file_entry as file_entry
    from trainer_client.core.format._manifest import fingerprints as fingerprints
    from trainer_client.core.format._manifest import newest_file_time as newest_file_time
    from trainer_client.core.format._manifest import parse_manifest as parse_manifest
    from trainer_client.core.format._manifest import quarantine_record as quarantine_record
    from trainer_client.core.format._manifest import read_manifest as read_manifest
    from trainer_client.core.format._manifest import read_verified_record as read_verified_record
    from trainer_client.core.format._manifest import seal_manifest as seal_manifest
    from trainer_client.core.format._manifest import training_summary as training_summary
    from trainer_client.core.format._manifest import write_manifest as write_manifest
    from trainer_client.core.format._manifest import write_verified_record as write_verified_record
    from trainer_client.core.format._parts import Claim as Claim
    from trainer_client.core.format._parts import PartInfo as PartInfo
    from trainer_client.core.format._parts import SaveParts as SaveParts
    from trainer_client.core.format._parts import changed_files as changed_files
    from trainer_client.core.format._parts import claimed_steps as claimed_steps
    from trainer_client.core.format._parts import incarnation_of as incarnation_of
    from trainer_client.core.format._parts import listed_parts as listed_parts
    from trainer_client.core.format._parts import make_claim as make_claim
    from trainer_client.core.format._parts import read_claim as read_claim
    from trainer_client.core.format._parts import read_part as read_part
    from trainer_client.core.format._parts import record_bytes as record_bytes
    from trainer_client.core.format._parts import record_path as record_path
    from trainer_client.core.format._parts import report_refused as report_refused
    from trainer_client.core.format._parts import save_parts as save_parts
    from trainer_client.core.format._parts import spans as spans
    from trainer_client.core.format._parts import staged_saves as staged_saves
    from trainer_client.core.format._parts import step_path_for as step_path_for
    from trainer_client.core.format._parts import take_over_claim as take_over_claim
    from trainer_client.core.format._peer_copies import FROM_PEER_FILE as FROM_PEER_FILE
    from trainer_client.core.format._peer_copies import copies_dir as copies_dir
    from trainer_client.core.format._private_files import check_private_dir as check_private_dir
    from trainer_client.core.format._private_files import ensure_private_dir as ensure_private_dir
    from trainer_client.core.format._private_files import is_real_dir as is_real_dir
    from trainer_client.core.format._private_files import make_private_dir as make_private_dir
    from trainer_client.core.format._private_files import open_private as open_private
    from trainer_client.core.format._private_files import read_private as read_private
    from trainer_client.core.format._private_files import write_private as write_private
    from trainer_client.core.format._records import SIDE_EVENTS_DIR as SIDE_EVENTS_DIR
    from trainer_client.core.format._records import RecordPlace as RecordPlace
    from trainer_client.core.format._records import record_location as record_location
    from trainer_client.core.format._records import record_paths as record_paths
    from trainer_client.core.format._records import side_dir as side_dir
    from trainer_client.core.format._records import side_job_dir as side_job_dir
    from trainer_client.core.format._records import side_records as side_records
    from trainer_client.core.format._saved_layout import StepLayout as StepLayout
    from trainer_client.core.format._saved_layout import read_step_layout as read_step_layout
    from trainer_client.core.format._snapshot import MAX_META_BYTES as MAX_META_BYTES
    from trainer_client.core.format._snapshot import ArrayRecord as ArrayRecord
    from trainer_client.core.format._snapshot import SnapshotMeta as SnapshotMeta
    from trainer_client.core.format._snapshot import damaged_shards as damaged_shards
    from trainer_client.core.format._snapshot import map_data as map_data
    from trainer_client.core.format._snapshot import problems as problems
    from trainer_client.core.format._snapshot import read_meta as read_meta
    from trainer_client.core.format._snapshot_dirs import complete_snapshots as complete_snapshots
    from trainer_client.core.format._snapshot_dirs import drop_leftovers as drop_leftovers
    from trainer_client.core.format._snapshot_dirs import evict as evict
    from trainer_client.core.format._snapshot_dirs import evict_oldest as evict_oldest
    from trainer_client.core.format._snapshot_dirs import is_persisted as is_persisted
    from trainer_client.core.format._snapshot_dirs import is_superseded as is_superseded
    from trainer_client.core.format._snapshot_dirs import job_dir as job_dir
    from trainer_client.core.format._snapshot_dirs import mark_persisted as mark_persisted
    from trainer_client.core.format._snapshot_dirs import mark_superseded as mark_superseded
    from trainer_client.core.format._snapshot_dirs import unmark_superseded as unmark_superseded
    from trainer_client.core.format._snapshot_shards import ShardReader as ShardReader
    from trainer_client.core.format._snapshot_shards import index_bounds as index_bounds
    from trainer_client.core.format._snapshot_shards import shard_grid as shard_grid
    from trainer_client.core.format._step_files import list_files as list_files
    from trainer_client.core.format._steps import DEFAULT_SAVE_TIMEOUT_S as DEFAULT_SAVE_TIMEOUT_S
    from trainer_client.core.format._steps import StepInspection as StepInspection
    from trainer_client.core.format._steps import inspect_step as inspect_step
    from trainer_client.core.format._steps import parse_step_name as parse_step_name
    from trainer_client.core.format._steps import step_entries as step_entries
    from trainer_client.core.format._stored_extents import contradiction_summary as contradiction_summary
    from trainer_client.core.format._stored_extents import stored_contradictions as stored_contradictions
    from trainer_client.core.format._tree_paths import rebuild as rebuild

_EXPORTS = {
    "trainer_client.core.format._array_index": ("decode_all_arrays",),
    "trainer_client.core.format._aside": ("AsideStep", "aside_name", "aside_state", "aside_steps"),
    "trainer_client.core.format._fates": ("Fate", "decide_fate", "read_fate", "read_fate_record"),
    "trainer_client.core.format._files": ("CHECKPOINT_METADATA", "CKPTD_MANIFEST", "CLAIMS_DIR", "COMMIT_MARKER",
                                          "EVENTS_DIR", "EVENTS_SUMMARY_FILE", "JOB_LOCK", "LEASE_DIR", "PARTS_DIR",
                                          "QUARANTINE_FILE", "SIDE_DIR", "SNAPSHOT_DATA_FILE", "SNAPSHOT_META_FILE",
                                          "VERIFIED_FILE"),
    "trainer_client.core.format._manifest": ("UNMANIFESTED", "FileEntry", "Manifest", "build_manifest", "file_entry",
                                             "fingerprints", "newest_file_time", "parse_manifest",
                                             "quarantine_record", "read_manifest", "read_verified_record",
                                             "seal_manifest", "training_summary", "write_manifest",
                                             "write_verified_record"),
    "trainer_client.core.format._parts": ("Claim", "PartInfo", "SaveParts", "changed_files", "claimed_steps",
                                          "incarnation_of", "listed_parts", "make_claim", "read_claim", "read_part",
                                          "record_bytes", "record_path", "report_refused", "save_parts", "spans",
                                          "staged_saves", "step_path_for", "take_over_claim"),
    "trainer_client.core.format._peer_copies": ("FROM_PEER_FILE", "copies_dir"),
    "trainer_client.core.format._private_files": ("check_private_dir", "ensure_private_dir", "is_real_dir",
                                                  "make_private_dir", "open_private", "read_private",
                                                  "write_private"),
    "trainer_client.core.format._records": ("SIDE_EVENTS_DIR", "RecordPlace", "record_location", "record_paths",
                                            "side_dir", "side_job_dir", "side_records"),
    "trainer_client.core.format._saved_layout": ("StepLayout", "read_step_layout"),
    "trainer_client.core.format._snapshot": ("MAX_META_BYTES", "ArrayRecord", "SnapshotMeta", "damaged_shards",
                                             "map_data", "problems", "read_meta"),
    "trainer_client.core.format._snapshot_dirs": ("complete_snapshots", "drop_leftovers", "evict", "evict_oldest",
                                                  "is_persisted", "is_superseded", "job_dir", "mark_persisted",
                                                  "mark_superseded", "unmark_superseded"),
    "trainer_client.core.format._snapshot_shards": ("ShardReader", "index_bounds", "shard_grid"),
    "trainer_client.core.format._step_files": ("list_files",),
    "trainer_client.core.format._steps": ("DEFAULT_SAVE_TIMEOUT_S", "StepInspection", "inspect_step",
                                          "parse_step_name", "step_entries"),
    "trainer_client.core.format._stored_extents": ("contradiction_summary", "stored_contradictions"),
    "trainer_client.core.format._tree_paths": ("rebuild",),
}

__all__ = exported(_EXPORTS)

if not TYPE_CHECKING:
    __getattr__, __dir__ = lazy_face(__name__, _EXPORTS)
