"""Retry with exponential backoff under an overall deadline: one ``RetryPolicy`` type, one decorator."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

_P = ParamSpec("_P")
_T = TypeVar("_T")


@dataclass(frozen=True)
class RetryPolicy:
    """Up to ``max_attempts`` tries, sleeping ``initial_backoff_s * multiplier**k`` (capped at
    ``max_backoff_s``) between them, and never starting a try after ``deadline_s`` has passed."""

    max_attempts: int = 3
    initial_backoff_s: float = 0.05
    max_backoff_s: float = 1.0
    multiplier: float = 2.0
    deadline_s: float | None = None

    def backoff(self, attempt: int) -> float:
        return min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** max(0, attempt - 1))


def retry(
    policy: RetryPolicy, retry_on: tuple[type[BaseException], ...]
) -> Callable[[Callable[_P, _T]], Callable[_P, _T]]:
    """Retry the decorated call on ``retry_on`` exceptions; re-raise the last one when out of tries."""

    def decorator(func: Callable[_P, _T]) -> Callable[_P, _T]:
        @functools.wraps(func)
        def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _T:
            start = time.monotonic()
            attempt = 0
            while True:
                attempt += 1
                try:
                    return func(*args, **kwargs)
                except retry_on:
                    pause = policy.backoff(attempt)
                    out_of_time = (
                        policy.deadline_s is not None and time.monotonic() - start + pause > policy.deadline_s
                    )
                    if attempt >= policy.max_attempts or out_of_time:
                        raise
                    time.sleep(pause)

        return wrapper

    return decorator


__all__ = ["RetryPolicy", "retry"]
