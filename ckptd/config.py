"""ckptd's settings: the one place where the sidecar and the ``ckptd`` command read their environment (prefix
``CKPTD_``): ``Settings`` for ``ckptd serve``, ``CliSettings`` for the commands that read a root themselves.

Command-line flags override these; tests build ``Settings`` directly.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from pydantic import AliasChoices, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from ckptd._peer_lists import hosts_named, parse_map, parse_peers
from trainer_client.core import protocol as p
from trainer_client.core._ckptd_url import socket_path_problem

# The value deploy/k8s/secret.example.yaml shows; a token starting like it was copied, not generated.
PLACEHOLDER_TOKEN_PREFIX = "REPLACE-WITH"
DEFAULT_PERSIST_NICE = 10  # how far below ckptd the persist worker runs, unless CKPTD_PERSIST_NICE says otherwise
UDS_MODES = ("0600", "0660")  # of ckptd's unix socket: the owner only, or the owner and the socket's group
MAX_HOSTS = 100_000  # hosts of one job at most (Kubernetes' limit on an Indexed Job's completions)


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


class Settings(BaseSettings):
    """Configuration of one ckptd process."""

    # hide_input_in_errors: a validation error must never print the token it was given.
    # populate_by_name: tests and callers give host_index/host_count by name; the environment by their aliases.
    model_config = SettingsConfigDict(env_prefix="CKPTD_", extra="ignore", hide_input_in_errors=True,
                                      populate_by_name=True)

    root: str = Field(default="./checkpoints", description="checkpoint root: a directory or gs://bucket/prefix")
    create_root: bool = Field(
        default=False, description="create a local root that does not exist (without it `serve` refuses to start)"
    )
    host: str = Field(
        default="127.0.0.1",
        description="listen address; anything but loopback without a token is warned about at startup",
    )
    port: int = Field(default=p.DEFAULT_PORT, ge=0, le=65535, description="listen port (clear of libtpu's 8470-8479)")
    uds: str | None = Field(
        default=None,
        description="listen on this unix socket instead of host:port (trainers: CKPTD_URL=unix:///ABS/PATH); its "
        "mode (CKPTD_UDS_MODE) is the access rule, its directory may not be writable by others",
    )
    uds_mode: str = Field(
        default="0600", description="the unix socket's mode: 0600 (this user only) or 0660 (and the socket's group)",
    )
    token: str | None = Field(default=None, repr=False, description="bearer token required on /v1 routes when set")
    token_file: str | None = Field(
        default=None,
        description="file holding the bearer token (e.g. a mounted Secret); read once at startup into `token`",
    )
    metrics_require_token: bool = Field(
        default=False, description="with a token set, GET /metrics needs it too (default: open for scrapers)"
    )
    max_body_bytes: int = Field(
        default=8 << 20, ge=1024,
        description="larger request bodies are refused with 413 (the largest valid request is ~3.5 MB)",
    )
    worker_threads: int = Field(
        default=8, ge=1, le=1024,
        description="threads that run the request handlers: a few keep /healthz prompt when ckptd is busy",
    )
    keep_alive_s: float = Field(
        default=75.0, gt=0,
        description="an idle HTTP connection is closed after this long (above the clients' and load balancers' idle "
        "timeouts, so a request never races the close)",
    )
    max_connections: int = Field(
        default=256, ge=1, le=65536,
        description="open HTTP connections at most (well below the process's file limit); a new one that finds them "
        "all taken takes the place of the oldest idle one (no request in progress); when every one has a request in "
        "progress a few more are taken for the probes only (/healthz, /readyz), anything else gets 503 BUSY",
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
    body_timeout_s: float = Field(
        default=30.0, gt=0,
        description="a request body must arrive whole within this long of its headers (else 408, closed)",
    )
    max_body_bytes_in_flight: int = Field(
        default=64 << 20, ge=1024,
        description="memory for request bodies, all requests together: each is charged its size before it is read "
        "and what parsing it takes once it is (past it: 503 BUSY; a body that alone takes more: 413)",
    )
    read_only: bool = Field(
        default=False,
        description="write nothing into any step directory of the root: manifests, verified and quarantine records "
        "go to <root>/.ckptd/<job>/<step>/, retention deletes nothing",
    )
    read_only_jobs: str = Field(
        default="", description="the same for these jobs only: job names separated by commas (e.g. `llama,maxtext`)",
    )
    state_dir: str | None = Field(
        default=None, description="where the catalog cache lives (default: a per-root dir under ~/.cache)"
    )
    refresh_interval_s: float = Field(default=2.0, gt=0, description="how often storage is rescanned")
    save_timeout_s: float = Field(
        default=3600.0, gt=0, description="a tmp step older than this is reported abandoned"
    )
    log_level: str = Field(default="info", description="log level (uvicorn's: trace, debug, info, warning, error)")
    adopt_after_s: float = Field(
        default=2.0, ge=0, description="adopt a step without a manifest once its files are unchanged this long"
    )
    revalidate_after_s: float = Field(
        default=30.0, gt=0,
        description="a good step is quick-validated again in full before it is named once its last check is this "
        "old (the size of each of its files is checked on every answer)",
    )
    keep_last: int | None = Field(default=None, ge=1, description="retention: keep the newest N good steps")
    keep_every: int | None = Field(default=None, ge=1, description="retention: keep steps that are multiples of K")
    keep_newer_than_s: float | None = Field(
        default=None, gt=0, description="retention: keep steps committed less than this many seconds ago"
    )
    clean_abandoned: bool = Field(default=True, description="delete saves abandoned for longer than save_timeout_s")
    gc_interval_s: float = Field(default=300.0, gt=0, description="how often retention runs in the server")
    drain_timeout_s: float = Field(
        default=20.0, ge=0, le=3600,
        description="on SIGTERM, how long to keep persisting the memory snapshots trainers asked for (keep it "
                    "below Kubernetes' terminationGracePeriodSeconds; what is left stays in shared memory)",
    )
    lease_ttl_s: float | None = Field(
        default=None, gt=0, le=86400,
        description="several sidecars on one root (a multi-host job): only the holder of a job's lease on storage "
        "writes its records and runs its retention, the others serve what it wrote; a follower takes over when the "
        "leader's heartbeat stopped this long (off: None, every sidecar writes; docs/multihost.md)",
    )
    shm_dir: str | None = Field(
        default=None, description="host-memory tier: the shared-memory directory trainers snapshot into (off: None)"
    )
    max_snapshots: int = Field(default=2, ge=1, description="host-memory tier: snapshots kept per job")
    peer_port: int | None = Field(
        default=None, ge=0, le=65535,
        description="peer copies: the port of the data channel other hosts' sidecars send their snapshot parts to "
        "(0: any free one; off: None; needs CKPTD_SHM_DIR and CKPTD_PEER_SECRET; docs/multihost.md, \"Peer copies\")",
    )
    peer_host: str = Field(default="127.0.0.1", description="peer copies: the data channel's listen address")
    peer_advertise: str | None = Field(
        default=None, description="peer copies: host:port the other hosts reach this one at (default: the listen "
        "address and port, the host's name when listening on all addresses)",
    )
    peer_secret: str | None = Field(
        default=None, repr=False,
        description="peer copies: the secret every sidecar of the job shares (at least 16 characters); the channel "
        "never starts without one, not even on loopback",
    )
    peer_secret_file: str | None = Field(default=None, description="file holding the peer secret (a mounted Secret)")
    peers: str = Field(
        default="", description="peer copies: the hosts' addresses as INDEX=HOST:PORT,... (JobSet's stable pod "
        "names); empty: each sidecar registers its own under <root>/<job>/.ckptd/peers/",
    )
    peer_copies: int = Field(default=1, ge=1, le=16, description="peer copies: hosts holding a copy of each part (K)")
    peer_stride: int = Field(
        default=1, ge=1, description="peer copies: hosts per failure domain; host k's copies go to k+stride, "
        "k+2*stride, ... (modulo the hosts)",
    )
    peer_map: str = Field(
        default="", description="peer copies: who holds whose part, ORIGIN:HOLDER[+HOLDER],... (overrides the stride)",
    )
    peer_bandwidth_bytes_s: float | None = Field(
        default=float(1 << 30), gt=0,
        description="peer copies: bytes per second sent to peers at most (None: unbounded)",
    )
    peer_refill: bool = Field(
        default=True, description="peer copies: a sidecar whose host's parts are gone brings the newest copy back "
        "unasked (off: only when its trainer asks)",
    )
    host_index: int | None = Field(
        default=None, ge=0, lt=MAX_HOSTS, validation_alias=AliasChoices("CKPTD_HOST_INDEX", "JOB_COMPLETION_INDEX"),
        description="peer copies: this host's index in its jobs (CKPTD_HOST_INDEX, else Kubernetes' "
        "JOB_COMPLETION_INDEX): with the host count, a sidecar on a new node brings its part back before any part "
        "or trainer tells it who it is (docs/multihost.md, \"Peer copies\")",
    )
    slice_index: int | None = Field(
        default=None, ge=0, lt=MAX_HOSTS, description="peer copies: this host's slice (a JobSet's job index: one "
        "Job per slice); with it the host index is the index within the slice (JOB_COMPLETION_INDEX is) and this "
        "host is slice_index x CKPTD_HOSTS_PER_SLICE + host index",
    )
    hosts_per_slice: int | None = Field(
        default=None, ge=1, le=MAX_HOSTS, description="peer copies: the hosts of each slice (needed with "
        "CKPTD_SLICE_INDEX)",
    )
    host_count: int | None = Field(
        default=None, ge=1, le=MAX_HOSTS, validation_alias=AliasChoices("CKPTD_HOST_COUNT"),
        description="peer copies: the hosts of the job (default: the hosts CKPTD_PEERS names, when it names "
        "0..N-1)",
    )
    peer_capacity_bytes: int | None = Field(
        default=None, ge=0, description="peer copies: bytes of other hosts' parts held at most (None: what shared "
        "memory has free, less 256 MiB for the trainer)",
    )
    persist_compression: bool = Field(default=False, description="zstd when persisting snapshots to storage")
    persist_devices: int = Field(
        default=16, ge=1, le=1024,
        description="fake CPU devices the persist worker writes a snapshot's shards from, in parallel",
    )
    persist_nice: int = Field(
        default=DEFAULT_PERSIST_NICE, ge=0, le=19,
        description="the persist worker runs this many nice steps below ckptd: the trainer wins the host's cores",
    )
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
    wedged_after_s: float = Field(
        default=30.0, gt=0,
        description="GET /healthz answers 503 once a probe task has waited this long for a handler thread",
    )
    max_jobs: int = Field(
        default=256, ge=1, le=100_000,
        description="jobs catalogued at most: scans ignore jobs past it (with a warning) and events may not create "
        "one (409 JOB_LIMIT); directories holding steps are kept before empty ones, then the most recently "
        "changed",
    )
    events_max_per_job: int = Field(
        default=10_000, ge=100, le=10_000_000,
        description="events kept per job on storage and in memory; older batches are folded into the job's event "
        "summary (goodput and totals keep counting them) and deleted",
    )
    events_max_bytes_per_job: int = Field(
        default=8 << 20, ge=64 << 10, description="bytes of event files kept per job (folded past it, like the events)",
    )
    events_memory_bytes: int = Field(
        default=64 << 20, ge=1 << 20,
        description="events held in memory over all jobs (file bytes + 1.5 KiB per event); the jobs used least "
        "recently are dropped first and read again when asked for",
    )

    def read_only_job_names(self) -> frozenset[str]:
        """``read_only_jobs`` as a set of names."""
        return frozenset(name.strip() for name in self.read_only_jobs.split(",") if name.strip())

    @model_validator(mode="after")
    def _read_token_file(self) -> Settings:
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
            try:
                text = Path(self.token_file).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise ValueError(f"cannot read {source}: {exc}") from None
            self.token = text.strip()
        if self.token is not None and (problem := token_problem(self.token)) is not None:
            raise ValueError(f"{source} {problem}")  # never the token itself
        if self.peer_secret_file is not None:
            if self.peer_secret is not None:
                raise ValueError("set CKPTD_PEER_SECRET or CKPTD_PEER_SECRET_FILE, not both")
            try:
                self.peer_secret = Path(self.peer_secret_file).read_text(encoding="utf-8").strip()
            except (OSError, UnicodeDecodeError) as exc:
                raise ValueError(f"cannot read the peer secret file {self.peer_secret_file!r}: {exc}") from None
        if self.peer_secret is not None and self.peer_secret.upper().startswith(PLACEHOLDER_TOKEN_PREFIX):
            raise ValueError("the peer secret is the placeholder of deploy/k8s/secret.example.yaml: create the Secret "
                             "with a random value (e.g. `openssl rand -hex 32`)")
        if self.peer_port is not None and (self.peer_secret is None or len(self.peer_secret) < 16):
            raise ValueError("CKPTD_PEER_PORT needs CKPTD_PEER_SECRET (or _FILE) of at least 16 characters, the same "
                             "on every host of the job (e.g. `openssl rand -hex 32`)")
        parse_peers(self.peers), parse_map(self.peer_map)  # ValueError naming the item that is malformed
        if self.slice_index is not None and self.host_index is not None:
            if self.hosts_per_slice is None:
                raise ValueError("CKPTD_SLICE_INDEX needs CKPTD_HOSTS_PER_SLICE (the host index is then the index "
                                 "within the slice: slice x hosts per slice + index)")
            if self.host_index >= self.hosts_per_slice:
                raise ValueError(f"the host index {self.host_index} (CKPTD_HOST_INDEX or JOB_COMPLETION_INDEX, within "
                                 f"slice {self.slice_index}) is not below CKPTD_HOSTS_PER_SLICE {self.hosts_per_slice}")
        count, index = self.host_count or hosts_named(self.peers), self.global_host_index()
        if index is not None and count is not None and index >= count:
            raise ValueError(f"the host index {index} (CKPTD_HOST_INDEX or JOB_COMPLETION_INDEX, with "
                             "CKPTD_SLICE_INDEX x CKPTD_HOSTS_PER_SLICE when set) is not below the host count "
                             f"{count} (CKPTD_HOST_COUNT, else the hosts CKPTD_PEERS names)")
        self._check_uds()
        bad = sorted(name for name in self.read_only_job_names() if not p.is_valid_job_name(name))
        if bad:
            raise ValueError(f"CKPTD_READ_ONLY_JOBS names invalid job names: {bad}")
        return self

    def _check_uds(self) -> None:
        """``uds`` made absolute and checked (it must fit in ``sun_path``; empty: unset), ``uds_mode`` one of the two
        modes."""
        if self.uds_mode.removeprefix("0o").rjust(4, "0") not in UDS_MODES:
            raise ValueError(f"CKPTD_UDS_MODE {self.uds_mode!r} must be 0600 (this user only) or 0660 (this user and "
                             "the socket's group): file permissions are who may reach ckptd over its socket")
        if not self.uds:  # an empty CKPTD_UDS: TCP, as when unset
            self.uds = None
            return
        self.uds = os.path.abspath(self.uds)
        if (problem := socket_path_problem(self.uds)) is not None:
            raise ValueError(f"CKPTD_UDS (--uds): {problem}")

    def socket_mode(self) -> int:
        """``uds_mode`` as a number (0o600 or 0o660)."""
        return int(self.uds_mode.removeprefix("0o"), 8)

    def this_host(self) -> tuple[int, int] | None:
        """``(this host's index, the hosts)`` when both are known: the index from ``CKPTD_HOST_INDEX`` (else
        ``JOB_COMPLETION_INDEX``; within its slice with ``CKPTD_SLICE_INDEX``), the count from ``CKPTD_HOST_COUNT``
        (else the hosts ``CKPTD_PEERS`` names)."""
        count, index = self.host_count or hosts_named(self.peers), self.global_host_index()
        return None if index is None or count is None else (index, count)

    def global_host_index(self) -> int | None:
        """This host's index in its jobs: ``host_index``, or with ``slice_index`` ``slice_index x hosts_per_slice
        + host_index`` (a JobSet of one Job per slice gives each pod its index within its Job only)."""
        if self.host_index is None or self.slice_index is None:
            return self.host_index
        return self.slice_index * (self.hosts_per_slice or 0) + self.host_index

    def catalog_path(self) -> Path:
        """The SQLite file of the catalog cache for this root."""
        if self.state_dir:
            base = Path(self.state_dir)
        else:
            cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
            digest = hashlib.sha256(self.root.encode()).hexdigest()[:16]
            base = cache / "ckptd" / digest
        base.mkdir(parents=True, exist_ok=True)
        return base / "catalog.sqlite3"


class CliSettings(BaseSettings):
    """What the commands that read a root without a server (``ckptd ls``, ``show``, ``plan``, ...) take from the
    environment: ``CKPTD_ROOT`` stands for a root not given, and the first contact with storage is bounded."""

    model_config = SettingsConfigDict(env_prefix="CKPTD_", extra="ignore")

    root: str | None = Field(
        default=None, description="the root of `ckptd ls` when none is given, and of a bare JOB given to the others",
    )
    storage_timeout_s: float = Field(
        default=15.0, gt=0, le=3600,
        description="how long a command waits for storage's first answer (a root that does not answer: one line "
        "naming the cause, exit 1)",
    )


__all__ = ["DEFAULT_PERSIST_NICE", "MAX_HOSTS", "PLACEHOLDER_TOKEN_PREFIX", "UDS_MODES", "CliSettings", "Settings",
           "token_problem"]
