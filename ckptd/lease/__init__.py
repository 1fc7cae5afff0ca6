"""One writer per job among the sidecars on one root: the leadership lease kept on storage (docs/multihost.md,
section 7). ``_lease`` holds ``LeaseBoard`` (every job's lease, renewed and taken over on a timer) and the one
look ``ckptd gc`` takes at who leads (``held_lease``); ``_lease_records`` what counts on storage (the files'
names, bounds and records, read as hostile: anyone who can write the root can plant files there).

A room of its own, below the catalog: the catalog asks it one question (``Catalog.writes``: does this sidecar
lead the job?) and holds the board the composition root built (``Catalog.lease``); the multi-host commit names
its saves' holder as the lease does (``default_holder``); the API and ``ckptd gc`` read it. It imports only
``trainer_client.core``'s faces (docs/architecture.md, "Package map"), so each of them can stand above it.
"""
