"""The HTTP service's settings groups, beside the code that uses them: the bearer token (``AuthSettings``:
``_auth.py``), the bounds on connections, requests and handler threads (``LimitSettings``: ``_limits.py``,
``_connections.py``, ``_pool_watch.py``) and on advice computations (``AdviceSettings``: ``_advice_runner.py``).

``ckptd/config.py`` composes them into ``Settings``; each field keeps the ``CKPTD_*`` variable it always had. This
module imports nothing of the service, so the shared layer can compose it (docs/architecture.md, "Package map").
"""

from __future__ import annotations

from pydantic import Field, model_validator

from ckptd._settings_group import PLACEHOLDER_TOKEN_PREFIX, SettingsGroup, read_secret


def token_problem(token: str) -> str | None:
    """Why ``token`` cannot serve as the bearer token (``None``: it can). It must be printable ASCII without
    spaces: what every HTTP client and browser sends unchanged in a header (RFC 6750's token characters and a
    few more), so ckptd compares the header's bytes with the token's."""
    if not token.strip():
        return "is empty: give a token (e.g. `openssl rand -hex 32`), or unset it to serve without one"
    if token != token.strip():
        return "has spaces or line breaks around it"
    if not all(33 <= ord(c) <= 126 for c in token):
        return "must be printable ASCII without spaces (e.g. `openssl rand -hex 32`)"
    if token.upper().startswith(PLACEHOLDER_TOKEN_PREFIX):
        return "is the placeholder of deploy/k8s/secret.example.yaml: create the Secret with a random value"
    return None


class AuthSettings(SettingsGroup):
    """The bearer token every /v1 route needs when one is set (docs/operations.md, "Security")."""

    token: str | None = Field(default=None, repr=False, description="bearer token required on /v1 routes when set")
    token_file: str | None = Field(
        default=None,
        description="file holding the bearer token (e.g. a mounted Secret); read once at startup into `token`",
    )
    metrics_require_token: bool = Field(
        default=False, description="with a token set, GET /metrics needs it too (default: open for scrapers)"
    )

    @model_validator(mode="after")
    def _read_token_file(self) -> AuthSettings:
        """Resolve ``token_file`` into ``token`` (whitespace stripped), so the app only ever reads ``token``, and
        refuse a token that cannot work (``token_problem``).

        A missing, unreadable or empty file, an empty ``CKPTD_TOKEN``, the example Secret's placeholder: each is
        an error at startup. Silently serving without auth, or with a token no client can send, is worse.
        """
        source = "CKPTD_TOKEN"
        if self.token_file is not None:
            if self.token is not None:
                raise ValueError("set CKPTD_TOKEN or CKPTD_TOKEN_FILE, not both")
            source = f"the token file {self.token_file!r} (CKPTD_TOKEN_FILE)"
            self.token = read_secret(self.token_file, source)
        if self.token is not None and (problem := token_problem(self.token)) is not None:
            raise ValueError(f"{source} {problem}")  # never the token itself
        return self


class LimitSettings(SettingsGroup):
    """The bounds on what clients may cost ckptd: connections, request heads and bodies, the time to send them,
    the handler threads (docs/operations.md, "What each limit defends")."""

    max_connections: int = Field(
        default=256, ge=1, le=65536,
        description="open HTTP connections at most (well below the process's file limit); a new one that finds them "
        "all taken takes the place of the oldest idle one (no request in progress); when every one has a request in "
        "progress a few more are taken for the probes only (/healthz, /readyz), anything else gets 503 BUSY",
    )
    keep_alive_s: float = Field(
        default=75.0, gt=0,
        description="an idle HTTP connection is closed after this long (above the clients' and load balancers' idle "
        "timeouts, so a request never races the close)",
    )
    max_header_bytes: int = Field(
        default=32 << 10, ge=4096, le=1 << 20,
        description="a request's line and headers together at most this large (431 HEADERS_TOO_LARGE)",
    )
    max_headers: int = Field(default=100, ge=10, le=10_000, description="headers per request at most (431)")
    header_timeout_s: float = Field(
        default=10.0, gt=0,
        description="a request's line and headers must arrive within this long of its first byte, a new "
        "connection's first request within this long of the connect (else 408 REQUEST_TIMEOUT, closed)",
    )
    max_body_bytes: int = Field(
        default=8 << 20, ge=1024,
        description="larger request bodies are refused with 413 (the largest valid request is ~3.5 MB)",
    )
    body_timeout_s: float = Field(
        default=30.0, gt=0,
        description="a request body must arrive whole within this long of its headers (else 408, closed)",
    )
    max_body_bytes_in_flight: int = Field(
        default=64 << 20, ge=1024,
        description="memory for request bodies, all requests together: each is charged its size before it is read "
        "and what parsing it takes once it is (past it: 503 BUSY; a body that alone takes more: 413)",
    )
    worker_threads: int = Field(
        default=8, ge=1, le=1024,
        description="threads that run the request handlers: a few keep /healthz prompt when ckptd is busy",
    )
    wedged_after_s: float = Field(
        default=30.0, gt=0,
        description="GET /healthz answers 503 once a probe task has waited this long for a handler thread",
    )


class AdviceSettings(SettingsGroup):
    """The advisor's computations behind ``GET /v1/jobs/{job}/advice``: on threads of their own, bounded in number,
    time and size, so resumes never wait on them."""

    advice_workers: int = Field(
        default=1, ge=1, le=16,
        description="advice computations at once, on threads of their own (more: 503 BUSY); resumes never wait on them",
    )
    advice_timeout_s: float = Field(
        default=10.0, gt=0, description="an advice computation is stopped after this long (503 BUSY)",
    )
    advice_max_failures: int = Field(
        default=200_000, ge=1000,
        description="simulated failures one advice may cost, estimated (~3 s; the default inputs: ~80,000); more: 422",
    )


__all__ = ["AdviceSettings", "AuthSettings", "LimitSettings", "token_problem"]
