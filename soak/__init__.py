"""The recovery soak (``make soak``): many consecutive elastic trials in one trainer process.

Each trial trains the demo MLP (examples/elastic_mlp.py) on 4 fake slices of 2 CPU devices against a real
``ckptd serve`` process, loses a slice from inside a JAX operation at a random phase (``soak.trials``), and
checks the run recovered exactly. Between trials the process keeps its PID, and its RSS, live arrays,
live executables and threads are sampled: what one recovery leaves behind must not add up.

``soak.harness`` holds what the trials share (the ckptd process, the slices and their fault injector, the
runner's configuration, the samples); ``soak.report`` turns the trials into ``soak/results.json`` and the
table in docs/operations.md ("Recovery soak"); ``python -m soak`` runs it (``SOAK_TRIALS``, ``SOAK_SEED``).
"""
