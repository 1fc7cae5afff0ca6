"""Runnable examples of trainer_client: the demo model and the `make demo` script."""
