"""The catalog: what ckptd knows about the steps of a storage root, kept right there. ``_catalog`` (``Catalog``:
scans and confirms; a cache rebuilt from storage at every start) with its SQLite tables (``_step_table``), the
jobs it takes (``_job_admission``), integrity (``_integrity``: adopt, seal, quarantine; ``_identity``: a verdict
tied to the step's content; ``_side_records``: a read-only job's verdict files), saved layouts (``_layouts``), a
job's lock (``_job_lock``), the refresher on its job workers (``_refresher``, ``_job_workers``), retention
(``_retention``), the commit tracker (``_commit_tracker``) and its settings groups (``_settings``:
``StorageSettings``, ``RetentionSettings``).

It stands on the rooms below it (``ckptd/events/``: the events it records; ``ckptd/lease/``: whether this
sidecar writes a job) and imports nothing above it: the multi-host commit (``ckptd/multihost/``) and the memory
tier (``ckptd/memory_tier/``) build on the catalog, and what the catalog runs of them (the commit pass beside the
refresher, the cleanup of multi-host saves in retention) is handed in by the composition root
(``ckptd/_sidecar.py``; docs/architecture.md, "Package map")."""
