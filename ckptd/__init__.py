"""ckptd: the checkpoint sidecar for elastic JAX training.

The service owns the checkpoint catalog of a storage root (local directory or ``gs://``) and answers,
after a failure, where a trainer resumes and on which mesh. Its core (catalog, commit rule, planning)
works on JSON metadata and never imports jax.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
