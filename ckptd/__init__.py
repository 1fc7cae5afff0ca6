"""ckptd: the checkpoint sidecar for elastic JAX training.

The service owns the checkpoint catalog of a storage root (local directory or ``gs://``) and answers,
after a failure, where a trainer resumes and on which mesh. Its parts (docs/architecture.md):
``ckptd.api`` (the HTTP service, ``create_app``), ``ckptd.catalog`` (what storage holds, integrity,
retention, the host-memory tier), ``ckptd.advisor`` (checkpoint periods and recovery policy) and
``ckptd.cli`` (the ``ckptd`` command). It never imports jax; the wire contract, stored format and
planner come from ``trainer_client.core``, shared with the trainer. Its persist worker, a child process,
is the one part that runs jax.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
