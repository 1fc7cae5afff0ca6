"""The persist worker: the child process that writes to storage what needs jax and Orbax, and the one typed
boundary ckptd's own process talks to it through.

``_worker_client`` is that boundary (typed requests and answers, the ``PersistWorkerError`` tree, ``PersistWorker``
and its two transports: ``PersistWorkerClient``, the child, started on the first request and restarted after a
crash; ``InProcessWorker`` for tests and benchmarks). ``_persist_worker`` is the child itself, ``python -m
ckptd.persist._persist_worker``: jax on the CPU, the Orbax writer of ``trainer_client.checkpoint_io``, a whole
memory snapshot persisted, one host's part written, a multi-host step committed from its parts.

A room of its own, at the bottom: it knows what a request asks for, not why it is asked. The memory tier's keeper
(``ckptd/memory_tier/``) and the multi-host commit (``ckptd/multihost/``) each own a client; nothing imports the
child, which is the one module of ckptd that imports jax (docs/architecture.md, "Package map").
"""
