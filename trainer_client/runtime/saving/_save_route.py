"""One route for a persistent save in every process of a multi-process job: all to memory, or all to Orbax.

With the memory tier on, a persistent save is a snapshot in each host's shared memory, and each host's ckptd
persists its part (docs/multihost.md, section 5); when a host's tier is full its save goes to Orbax directly
instead. A multi-process Orbax save is collective: if one host took that route while another's tier had room,
the first would wait in Orbax's barrier for processes that never come (a hang). So each process tries its
memory save, then the processes agree through JAX's coordination-service key-value store
(``trainer_client.runtime.multihost._job_store``): each publishes whether its snapshot was taken (``memory``) or its
tier
was full (``full``) and reads every other's; if any was full, every process saves through Orbax (those that
took a snapshot too: it stays in their memory, and their ckptd, finding the step committed on storage, marks
its part persisted). No device work, so no collective is needed to agree. The same exchange carries whether
each process's previous direct save is still being written: with ``if_busy="skip"`` a save to Orbax is skipped
by every process when any of them is busy (a process that skipped while another started the collective save
would leave that one waiting in its barrier). A job without a memory tier agrees the same way (every save
goes to Orbax: only the skip is decided).

Keys are unique per save: ``ckptd/save_route/<job incarnation>/<step>/<n>/<process>``, ``n`` counting this
process's agreements on that step in this incarnation (every process makes the same persistent saves in the
same order), so a step saved again never reads an earlier save's answers. The store starts empty with every
incarnation of the job. Each wait for another process's answer lasts at most ``CKPTD_ROUTE_TIMEOUT_S``
(600 s by default: the slowest process's way to this save, a step and its device-to-host copy); a process
whose snapshot fails answers all the same (``Saver.save``), so only a dead process is waited for, and a dead
process ends the job anyway (docs/multihost.md, section 2).
"""

from __future__ import annotations

import logging
from collections import Counter

from trainer_client.config import ClientSettings
from trainer_client.core.protocol import Tier
from trainer_client.runtime.multihost._job_store import JobProcess, KeyValueStore

_log = logging.getLogger(__name__)

# a process's answer: its snapshot taken (the memory tier's name) or not ("full": saved through Orbax), with
# "+busy" when its previous direct save is still being written
Answer = str
IN_MEMORY, FULL, BUSY = Tier.MEMORY.value, "full", "+busy"


class SaveRoute(JobProcess):
    """The agreement on each persistent save's route among the ``process_count`` processes of one job
    incarnation (``incarnation``: the same in every process, e.g. ``MemoryTier.incarnation``; ``timeout_ms``:
    the wait for each other process's answer, unless given the ``route_timeout_s`` of ``settings``: the
    runner's, or ``CKPTD_ROUTE_TIMEOUT_S`` when none are given)."""

    def __init__(self, incarnation: str, process_index: int, process_count: int, *,
                 store: KeyValueStore | None = None, timeout_ms: int | None = None,
                 settings: ClientSettings | None = None) -> None:
        super().__init__(process_index, process_count, store=store, timeout_ms=timeout_ms, settings=settings)
        self.incarnation = incarnation
        self._agreed: Counter[int] = Counter()  # agreements per step so far, in this process

    def tell(self, step: int, mine: Answer) -> str:
        """Publish this process's answer for its next save of ``step`` without waiting for the others' (a
        process about to raise: the others read it and go on); returns the save's key prefix."""
        prefix = f"ckptd/save_route/{self.incarnation}/{step}/{self._agreed[step]}"
        self._agreed[step] += 1
        self.store.key_value_set(f"{prefix}/{self.index}", mine)
        return prefix

    def answers(self, step: int, mine: Answer) -> list[str]:
        """Publish this process's answer for its next save of ``step`` and read every process's (waiting up
        to ``timeout_ms`` for each: a process that never comes is a dead host, which ends the job anyway)."""
        prefix = self.tell(step, mine)
        return [mine if k == self.index else self.store.blocking_key_value_get(f"{prefix}/{k}", self.timeout_ms)
                for k in range(self.count)]

    def agree(self, step: int, in_memory: bool, busy: bool = False) -> tuple[bool, bool]:
        """``(every process took its memory snapshot, some process's previous direct save is still being
        written)`` for this save of ``step`` (``in_memory``, ``busy``: this process's). Not all in memory:
        every process saves it through Orbax."""
        mine = IN_MEMORY if in_memory else FULL
        answers = self.answers(step, mine + BUSY if busy else mine)
        full = [k for k, answer in enumerate(answers) if answer.partition("+")[0] != IN_MEMORY]
        if full and in_memory:
            _log.warning("the memory tier of process(es) %s is full: step %s is saved through Orbax by every "
                         "process (its snapshot here stays in memory)", full, step)
        return not full, any(answer.endswith(BUSY) for answer in answers)


__all__ = ["BUSY", "FULL", "IN_MEMORY", "Answer", "SaveRoute"]
