"""The jax-free core: step naming and the commit rule, the planner, the zarr/OCDBT index."""
