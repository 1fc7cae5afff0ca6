"""Saying a refusal once: whether a warning about a path, for a reason, was already logged by this process.

Why it exists: scans run every refresh (every second or so), and a refusal found by each of them — a link
leading out of the root, a forged claim or part record — was logged every time (a link: 7 times in 14 s),
where the docs promise once (docs/operations.md, "Limits under load and hostile input"). ``SaidOnce``
remembers the reason last said per path; a path refused for another reason is said again. What it
remembers is bounded (the least recently said are forgotten first), so a root planted with millions of
links costs a few hundred kilobytes, not a growing set.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

KEPT = 4096


class SaidOnce:
    """``first(path, why)``: True the first time ``path`` is refused for ``why`` (say it then), False after."""

    def __init__(self, kept: int = KEPT) -> None:
        self.kept = kept
        self._lock = threading.Lock()
        self._said: OrderedDict[str, str] = OrderedDict()  # path -> the reason last said

    def first(self, path: str, why: str) -> bool:
        with self._lock:
            if self._said.get(path) == why:
                self._said.move_to_end(path)
                return False
            self._said[path] = why
            self._said.move_to_end(path)
            while len(self._said) > self.kept:
                self._said.popitem(last=False)
            return True


__all__ = ["KEPT", "SaidOnce"]
