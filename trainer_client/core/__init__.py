"""The jax-free core that the sidecar and the trainer both import.

Everything the two sides must agree on lives here and nowhere else: the wire contract
(``core.protocol``), the stored format (``core.format``: step naming and the commit rule, manifests and
verified records, the OCDBT/zarr index, the host-memory snapshot format, the file names of all of them),
the resume planner (``core.planner``, ``core.batching``), the checkpoint period model (``core.planning``: the
advisor's first-order periods and the runner's autopilot), validation (``core.validation``) and storage
access (``core.storage``). Nothing under this package imports jax, orbax, the server framework or the
rest of ``trainer_client``; tensorstore is imported only inside the functions that read zarr metadata.
See docs/architecture.md for the package map.
"""
