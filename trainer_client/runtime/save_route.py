"""One route for a persistent save in every process of a multi-process job: all to memory, or all to Orbax.

With the memory tier on, a persistent save is a snapshot in each host's shared memory, and each host's ckptd
persists its part (docs/multihost.md, section 5); when a host's tier is full its save goes to Orbax directly
instead. A multi-process Orbax save is collective: if one host took that route while another's tier had room,
the first would wait in Orbax's barrier for processes that never come (a hang). So each process tries its
memory save, then the processes agree through JAX's coordination-service key-value store
(``trainer_client.runtime.job_store``): each publishes whether its snapshot was taken (``memory``) or its tier
was full (``full``) and reads every other's; if any was full, every process saves through Orbax (those that
took a snapshot too: it stays in their memory, and their ckptd, finding the step committed on storage, marks
its part persisted). No device work, so no collective is needed to agree.

Keys are unique per save: ``ckptd/save_route/<job incarnation>/<step>/<n>/<process>``, ``n`` counting this
process's agreements on that step in this incarnation (every process makes the same persistent saves in the
same order), so a step saved again never reads an earlier save's answers. The store starts empty with every
incarnation of the job.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Literal

from trainer_client.runtime.job_store import KeyValueStore, job_store

_log = logging.getLogger(__name__)

ROUTE_TIMEOUT_MS = 600_000  # the slowest process's way to this save (a step, its device-to-host copy)
Answer = Literal["memory", "full"]


class SaveRoute:
    """The agreement on each persistent save's route among the ``process_count`` processes of one job
    incarnation (``incarnation``: the same in every process, e.g. ``MemoryTier.incarnation``)."""

    def __init__(self, incarnation: str, process_index: int, process_count: int, *,
                 store: KeyValueStore | None = None, timeout_ms: int = ROUTE_TIMEOUT_MS) -> None:
        if not 0 <= process_index < process_count:
            raise ValueError(f"process {process_index} of {process_count}")
        self.incarnation = incarnation
        self.index = process_index
        self.count = process_count
        self.timeout_ms = timeout_ms
        self._store = store
        self._agreed: Counter[int] = Counter()  # agreements per step so far, in this process

    @property
    def store(self) -> KeyValueStore:
        if self._store is None:
            self._store = job_store()
        return self._store

    def answers(self, step: int, mine: Answer) -> list[str]:
        """Publish this process's answer for its next save of ``step`` and read every process's (waiting up
        to ``timeout_ms`` for each: a process that never comes is a dead host, which ends the job anyway)."""
        prefix = f"ckptd/save_route/{self.incarnation}/{step}/{self._agreed[step]}"
        self._agreed[step] += 1
        self.store.key_value_set(f"{prefix}/{self.index}", mine)
        return [mine if k == self.index else self.store.blocking_key_value_get(f"{prefix}/{k}", self.timeout_ms)
                for k in range(self.count)]

    def all_in_memory(self, step: int, in_memory: bool) -> bool:
        """Whether every process took its memory snapshot of this save of ``step`` (``in_memory``: whether
        this one did); False: every process saves it through Orbax."""
        answers = self.answers(step, "memory" if in_memory else "full")
        full = [k for k, answer in enumerate(answers) if answer != "memory"]
        if full and in_memory:
            _log.warning("the memory tier of process(es) %s is full: step %s is saved through Orbax by every "
                         "process (its snapshot here stays in memory)", full, step)
        return not full


__all__ = ["ROUTE_TIMEOUT_MS", "SaveRoute"]
