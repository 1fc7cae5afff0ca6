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
OCDBT_DATA_DIR = "d"  # <item>/d/ (or <store>/d/): an OCDBT store's data files
ARRAY_METADATAS = "array_metadatas"  # <item>/array_metadatas/process_<k>: each process's arrays' metadata
STRINGS_FILE = "_strings.json"  # <item>/_strings.json: the PyTree handler's string leaves
ITER_ITEM = "iter"  # the item name Grain's users (MaxText) give the data iterator's state
ITER_SHARED_FILE = "process_0.json"  # iter/process_0.json: MaxText's ElasticIterator layout (one state for all)

# ---- ckptd's files beside Orbax's in a step directory -----------------------------------------------
CKPTD_MANIFEST = "ckptd_manifest.json"  # every file's size and CRC32C, written before the commit
QUARANTINE_FILE = "ckptd_quarantine.json"  # why a step was found bad (the step is kept, never served)
VERIFIED_FILE = "ckptd_verified.json"  # a verdict some ckptd reached, so a restart need not verify again

# ---- ckptd's own directory: in a job (<job>/.ckptd/) and at the root (the side prefix, records.py) ---
SIDE_DIR = ".ckptd"  # never a job's or a step's name
EVENTS_DIR = ".ckptd/events"  # <job>/.ckptd/events/: elastic events, one object per batch
EVENTS_SUMMARY_FILE = "summary.json"  # <events dir>/summary.json: what rotated-out events added up to
SIDE_EVENTS_DIR = ".ckptd/.events"  # <root>/.ckptd/.events/<job>/: a read-only job's elastic events
CLAIMS_DIR = ".ckptd/claims"  # <job>/.ckptd/claims/: a multi-process save's claim (docs/multihost.md)
STAGING_DIR = ".ckptd/staging"  # <job>/.ckptd/staging/: its host parts until the commit
JOB_LOCK = ".ckptd/job.lock"  # <job>/.ckptd/job.lock (0600): flocked by a job's commit and cleanup (local roots)
PARTS_DIR = "ckptd_parts"  # <step>/ckptd_parts/: the part records of a step committed from host parts
LEASE_DIR = "leader"  # <job>/.ckptd/leader/: the leadership lease's epochs (docs/multihost.md)
# an Orbax item's name, as a snapshot or a part record may give it (one plain path segment)
ITEM_NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"

# ---- a host-memory snapshot: <shm>/<job>/<step>/ ----------------------------------------------------
SNAPSHOT_DATA_FILE = "data.bin"  # every shard's bytes, each 64-byte aligned
SNAPSHOT_META_FILE = "snapshot.json"  # the snapshot's description (written last: its presence commits it)
SNAPSHOT_TREEDEF_FILE = "treedef.pickle"  # the state's tree structure, read only by the process that wrote it
SNAPSHOT_PERSISTED_FILE = "persisted.json"  # ckptd wrote the snapshot to storage
# ckptd will not persist it: a newer snapshot marked persist took its place while a persist was still running
SNAPSHOT_SUPERSEDED_FILE = "superseded.json"
SNAPSHOT_SPARE_PREFIX = ".spare-"  # + the writer's pid: a preallocated file the writer's next snapshot fills

__all__ = [
    "ARRAY_METADATAS",
    "CHECKPOINT_METADATA",
    "CKPTD_MANIFEST",
    "CLAIMS_DIR",
    "COMMIT_MARKER",
    "DEFAULT_ITEM",
    "EVENTS_DIR",
    "EVENTS_SUMMARY_FILE",
    "ITEM_METADATA",
    "ITEM_NAME_PATTERN",
    "ITER_ITEM",
    "ITER_SHARED_FILE",
    "JOB_LOCK",
    "LEASE_DIR",
    "OCDBT_DATA_DIR",
    "OCDBT_MANIFEST",
    "OCDBT_PROCESS_PREFIX",
    "PARTS_DIR",
    "QUARANTINE_FILE",
    "ROOT_ITEM",
    "SHARDING_FILE",
    "SIDE_DIR",
    "SIDE_EVENTS_DIR",
    "SNAPSHOT_DATA_FILE",
    "SNAPSHOT_META_FILE",
    "SNAPSHOT_PERSISTED_FILE",
    "SNAPSHOT_SPARE_PREFIX",
    "SNAPSHOT_SUPERSEDED_FILE",
    "SNAPSHOT_TREEDEF_FILE",
    "STAGING_DIR",
    "STRINGS_FILE",
    "TMP_DIR_SUFFIX",
    "VERIFIED_FILE",
]
