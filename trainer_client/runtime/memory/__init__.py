"""The shared-memory tier: snapshots in ``/dev/shm`` beside ckptd that survive the trainer process, with their
spare files made ahead and their restore checked shard by shard."""
