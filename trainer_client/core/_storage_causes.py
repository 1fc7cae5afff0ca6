"""What a storage failure comes down to, in words a person acts on: credentials, the network, or the backend's own.

gcsfs, aiohttp and google-auth raise many types for the same trouble (a DNS failure, a refused connection and a
timeout are all "the network"; a 401, a 403 and an anonymous caller are all "credentials"), and gcsfs reports the
errors it retries only as log text. ``failure_cause`` reads the words of a failure and its causes, or of such a
text, and names the cause in one line: what ``ckptd ls gs://...`` says instead of a traceback
(``ckptd/cli/_reach.py``), and what ``Storage.is_dir`` puts in its ``StorageError``.
"""

from __future__ import annotations

_CAUSES = (  # words in a failure's text -> what it comes down to, for a person (first match wins)
    ("credentials", ("credential", "anonymous caller", "does not have storage.", "forbidden", "unauthorized",
                     "invalid_grant", "access denied")),
    ("network", ("cannot connect", "connect call failed", "connection refused", "name or service not known",
                 "temporary failure in name resolution", "timed out", "timeout", "network is unreachable",
                 "connection reset", "server disconnected", "no route to host")),
)


def failure_cause(failure: BaseException | str) -> str:
    """One line saying what a storage failure comes down to: ``credentials: ...``, ``network: ...``, or the
    backend's own first line. gcsfs and aiohttp raise many types for these (and gcsfs logs the retried ones
    as text), so the words decide, over the whole chain of causes."""
    texts: list[str] = []
    seen: set[int] = set()
    current: BaseException | None = failure if isinstance(failure, BaseException) else None
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        texts.append(f"{type(current).__module__}.{type(current).__name__}: {current}")
        current = current.__cause__ or current.__context__
    first = (str(failure) if isinstance(failure, str) else texts[0].split(": ", 1)[-1] or type(failure).__name__)
    first = " ".join(first.split())  # one line, whatever the backend put in it
    words = " ".join(texts or [str(failure)]).lower()
    for cause, hints in _CAUSES:
        if any(h in words for h in hints) or (cause == "credentials" and "google.auth" in words):
            return f"{cause}: {first}"
    return first


__all__ = ["failure_cause"]
