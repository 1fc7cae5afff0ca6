"""Every file and directory name ckptd reads or writes, in one place.

A step directory is Orbax's own layout (docs/architecture.md, invariant 1) plus ckptd's few files beside
it; a host-memory snapshot is ckptd's own format. Readers and writers on both sides take the names from
here, so a name is defined once.
"""

from __future__ import annotations

# ---- Orbax's layout of a step (what plain Orbax writes and reads) -----------------------------------
TMP_DIR_SUFFIX = ".orbax-checkpoint-tmp"  # <step><suffix>: a local save not finalized yet
COMMIT_MARKER = "commit_success.txt"  # written when Orbax finalized the step (the commit rule)
CHECKPOINT_METADATA = "_CHECKPOINT_METADATA"  # JSON: item handlers, timestamps, custom metadata
ITEM_METADATA = "_METADATA"  # <item>/_METADATA: tree structure, per-leaf value type and write shape
SHARDING_FILE = "_sharding"  # <item>/_sharding: each leaf's sharding (mesh, axis names, partition spec)
DEFAULT_ITEM = "default"  # the item a CheckpointManager without item names writes
ROOT_ITEM = ""  # the item a bare Checkpointer (StandardCheckpointer, PyTreeCheckpointer) writes: the step itself
OCDBT_MANIFEST = "manifest.ocdbt"  # <item>/manifest.ocdbt: the root of an OCDBT key-value store
OCDBT_PROCESS_PREFIX = "ocdbt.process_"  # per-process OCDBT stores of a save not merged yet

# ---- ckptd's files beside Orbax's in a step directory -----------------------------------------------
CKPTD_MANIFEST = "ckptd_manifest.json"  # every file's size and CRC32C, written before the commit
QUARANTINE_FILE = "ckptd_quarantine.json"  # why a step was found bad (the step is kept, never served)
VERIFIED_FILE = "ckptd_verified.json"  # a verdict some ckptd reached, so a restart need not verify again

# ---- ckptd's own directory: in a job (<job>/.ckptd/) and at the root (the side prefix, records.py) ---
SIDE_DIR = ".ckptd"  # never a job's or a step's name
EVENTS_DIR = ".ckptd/events"  # <job>/.ckptd/events/: elastic events, one object per batch
# an Orbax item's name, as a snapshot or a part record may give it (one plain path segment)
ITEM_NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"

# ---- a host-memory snapshot: <shm>/<job>/<step>/ ----------------------------------------------------
SNAPSHOT_DATA_FILE = "data.bin"  # every shard's bytes, each 64-byte aligned
SNAPSHOT_META_FILE = "snapshot.json"  # the snapshot's description (written last: its presence commits it)
SNAPSHOT_TREEDEF_FILE = "treedef.pickle"  # the state's tree structure, read only by the process that wrote it
SNAPSHOT_PERSISTED_FILE = "persisted.json"  # ckptd wrote the snapshot to storage
SNAPSHOT_SPARE_PREFIX = ".spare-"  # + the writer's pid: a preallocated file the writer's next snapshot fills

__all__ = [
    "CHECKPOINT_METADATA",
    "CKPTD_MANIFEST",
    "COMMIT_MARKER",
    "DEFAULT_ITEM",
    "EVENTS_DIR",
    "ITEM_METADATA",
    "ITEM_NAME_PATTERN",
    "OCDBT_MANIFEST",
    "OCDBT_PROCESS_PREFIX",
    "QUARANTINE_FILE",
    "ROOT_ITEM",
    "SHARDING_FILE",
    "SIDE_DIR",
    "SNAPSHOT_DATA_FILE",
    "SNAPSHOT_META_FILE",
    "SNAPSHOT_PERSISTED_FILE",
    "SNAPSHOT_SPARE_PREFIX",
    "SNAPSHOT_TREEDEF_FILE",
    "TMP_DIR_SUFFIX",
    "VERIFIED_FILE",
]
