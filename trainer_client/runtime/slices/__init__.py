"""Slices: which devices form each slice, which are healthy (pathwaysutils' elastic manager), and the simulated
slices and in-JAX faults the tests and the demo lose on purpose."""
