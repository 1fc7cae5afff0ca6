"""Compilation: JAX's persistent cache and the compile-ahead of the meshes a recovery would need next."""
