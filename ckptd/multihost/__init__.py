"""Multi-host saves on ckptd's side (docs/multihost.md, section 5), jax-free: a multi-process job's step
persisted from its hosts' parts and committed once by the job's leader.

``_part_commit`` (``PartSaves``: claims, a dead incarnation's claim taken over, part records, the leader's commit,
the cleanup of a save never completed), ``_in_place`` (what its parties delete on ``gs://``, only as they listed
it), ``_commit_pass`` (``CommitPass``: the leader's commits over every job the catalog knows, a worker of the
sidecar) and ``_abandoned_parts`` (retention's part: the saves never completed, deleted).

A room of its own, above the catalog and below the memory tier: it stands on the catalog's job lock (a commit,
a cleanup and retention of one job exclude each other) and retention's ``Decision`` records, on the lease's
name for a holder and on the persist worker (the Orbax merge); the memory tier's keeper writes a host's part
through it. The catalog imports nothing of it: the composition root (``ckptd/_sidecar.py``) runs the commit pass
beside the catalog's refresher and hands the cleanup to the catalog's retention (docs/architecture.md, "Package
map").
"""
