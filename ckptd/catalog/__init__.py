"""What ckptd knows about storage and keeps right there: the catalog (a cache rebuilt from storage),
integrity (adopt, seal, quarantine), retention, commit tracking, stored events, and the host-memory
snapshots with the persist worker (a child process, the one part of the server that imports jax)."""
