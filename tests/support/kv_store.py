"""JAX's coordination-service key-value store, in one process, for unit tests of what the processes of a job
agree through it (``trainer_client.runtime.multihost._job_store.KeyValueStore``): create-only sets, blocking gets,
directory reads and deletes (docs/multihost.md)."""

from __future__ import annotations

import threading


class InProcessKeyValueStore:
    """Create-only ``key_value_set`` (unless ``allow_overwrite``), ``blocking_key_value_get`` that waits up to
    its timeout (a test failure past it), ``key_value_dir_get`` and ``key_value_delete`` as jaxlib's (a key and
    the keys under it), shared by threads standing in for the job's processes."""

    def __init__(self) -> None:
        self.values: dict[str, str] = {}
        self.cond = threading.Condition()

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
        with self.cond:
            assert allow_overwrite or key not in self.values, key
            self.values[key] = value
            self.cond.notify_all()

    def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str:
        with self.cond:
            assert self.cond.wait_for(lambda: key in self.values, timeout_in_ms / 1000), key
            return self.values[key]

    def key_value_dir_get(self, key: str) -> list[tuple[str, str]]:
        with self.cond:
            return sorted((k, v) for k, v in self.values.items() if k.startswith(key.rstrip("/") + "/"))

    def key_value_delete(self, key: str) -> None:
        with self.cond:
            for k in [k for k in self.values if k == key or k.startswith(key + "/")]:
                del self.values[k]


__all__ = ["InProcessKeyValueStore"]
