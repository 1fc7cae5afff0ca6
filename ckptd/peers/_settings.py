"""The peer channel's settings group (``PeerSettings``), beside the channel that uses it: the data channel's
address and secret, the other hosts' addresses, who holds whose part, and this host's index among them
(docs/multihost.md, "Peer copies").

``ckptd/config.py`` composes it into ``Settings`` and the composition root hands it to ``build_peers``; each field
keeps the ``CKPTD_*`` variable it always had. It imports nothing of the channel, so the shared layer can compose it
(docs/architecture.md, "Package map").
"""

from __future__ import annotations

from pydantic import AliasChoices, Field, model_validator

from ckptd._peer_lists import hosts_named, parse_map, parse_peers
from ckptd._settings_group import PLACEHOLDER_TOKEN_PREFIX, SettingsGroup, read_secret
from trainer_client.core.protocol import MAX_HOSTS  # hosts of one job at most (the wire's bound too)


class PeerSettings(SettingsGroup):
    """Peer copies: each host's sidecar keeps copies of other hosts' snapshot parts (off unless ``peer_port``)."""

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

    @model_validator(mode="after")
    def _check(self) -> PeerSettings:
        """Resolve ``peer_secret_file`` into ``peer_secret`` and refuse what cannot work: a placeholder or short
        secret with the channel on, a malformed list, a host index outside its slice or the job."""
        if self.peer_secret_file is not None:
            if self.peer_secret is not None:
                raise ValueError("set CKPTD_PEER_SECRET or CKPTD_PEER_SECRET_FILE, not both")
            self.peer_secret = read_secret(self.peer_secret_file, f"the peer secret file {self.peer_secret_file!r}")
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
        return self

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


__all__ = ["MAX_HOSTS", "PeerSettings"]
