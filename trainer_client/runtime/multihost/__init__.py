"""A multi-controller job: every process agrees on the step to resume from and saves at the same steps, through
JAX's coordination service (its key-value store)."""
