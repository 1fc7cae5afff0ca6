"""How much host memory the autopilot's host-memory tiers may hold on this host, read from the machine.

Why it exists: the replica snapshots and the shared-memory snapshots both live in the host's memory, and the
shared-memory pages are charged to the trainer's cgroup: a tier that outgrows the container's limit gets the
trainer killed by the kernel, not refused. The period model (``trainer_client.core.planning``) leaves off the
tiers that do not fit a budget (``Constraints.host_memory_bytes``); this module gives it one when the user did
not (``AutopilotOptions.host_memory_budget_bytes``): the container's memory limit (cgroup v2 ``memory.max``, or
v1 ``memory.limit_in_bytes``, of this process's cgroup and every cgroup above it), else the machine's
(``/proc/meminfo`` ``MemTotal``), the smallest of those set, less ``RESERVE_FRACTION`` for everything else the
host runs (the trainer itself, ckptd, the kernel).

Every value read is treated as hostile: each file is read without following a final symlink, only if it is a
regular file, at most a few bytes of it, and a number outside ``PLAUSIBLE_BYTES`` (a cgroup without a limit says
``max``, or 2^63 rounded down to a page in v1) or text that is not a number counts as no answer. A cgroup path
that climbs (``..``) or is too deep is not followed. Nothing read: no budget (the model leaves the tiers on).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

RESERVE_FRACTION = 0.25  # of the host's limit, kept for what else lives in its memory
PLAUSIBLE_BYTES = (16 << 20, 1 << 52)  # a limit outside these (16 MiB .. 4 PiB) is no limit, or garbage
_MAX_READ = 64 << 10  # bytes read of any one file (/proc/meminfo is ~1.5 KiB; a cgroup limit a few bytes)
_MAX_DEPTH = 64  # components of a cgroup path followed


@dataclass(frozen=True)
class HostMemory:
    """A budget for the host-memory tiers: ``budget_bytes``, and where it comes from (``source``: ``option``,
    or the file its limit was read from, less the reserve)."""

    budget_bytes: float
    source: str


def _read(path: Path) -> str | None:
    """At most ``_MAX_READ`` bytes of a regular file, as text; None when it is not one or cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.read(fd, _MAX_READ).decode("ascii", errors="replace")
    except OSError:
        return None
    finally:
        os.close(fd)


def _plausible(value: int) -> int | None:
    low, high = PLAUSIBLE_BYTES
    return value if low <= value <= high else None


def _limit(text: str | None) -> int | None:
    """A cgroup limit file's value in bytes; None for ``max``, unlimited or anything that is not a number."""
    if text is None:
        return None
    word = text.strip()
    if not word.isascii() or not word.isdigit() or len(word) > 20:
        return None
    return _plausible(int(word))


def mem_total(text: str | None) -> int | None:
    """``MemTotal`` of ``/proc/meminfo`` text, in bytes (the file says kB, meaning KiB); None when absent or odd."""
    for line in (text or "").splitlines():
        name, _, rest = line.partition(":")
        if name != "MemTotal":
            continue
        parts = rest.split()
        if len(parts) != 2 or parts[1] != "kB" or not parts[0].isascii() or not parts[0].isdigit() \
                or len(parts[0]) > 16:
            return None
        return _plausible(int(parts[0]) * 1024)
    return None


def _safe_path(text: str) -> PurePosixPath | None:
    """A cgroup path from ``/proc/self/cgroup``, or None when it is not one to follow (relative, climbing, deep)."""
    if not text.startswith("/") or "\x00" in text or len(text) > 4096:
        return None
    path = PurePosixPath(text)
    parts = path.parts[1:]
    if len(parts) > _MAX_DEPTH or any(p in ("..", ".") for p in parts):
        return None
    return path


def cgroup_paths(text: str | None) -> tuple[PurePosixPath | None, PurePosixPath | None]:
    """``(cgroup v2 path, cgroup v1 memory path)`` of ``/proc/self/cgroup`` text (``0::/a/b``, ``4:memory:/a``)."""
    v2 = v1 = None
    for line in (text or "").splitlines()[:256]:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        number, controllers, path = fields
        if number == "0" and controllers == "":
            v2 = _safe_path(path)
        elif "memory" in controllers.split(","):
            v1 = _safe_path(path)
    return v2, v1


def _chain(mount: Path, path: PurePosixPath | None) -> list[Path]:
    """``mount`` joined with ``path`` and each of its ancestors, the deepest first, the mount itself last (inside a
    container's cgroup namespace the process's own cgroup is the mount's root)."""
    out: list[Path] = []
    if path is not None:
        parts = path.parts[1:]
        for depth in range(len(parts), 0, -1):
            out.append(mount.joinpath(*parts[:depth]))
    out.append(mount)
    return out


def host_memory_limit(proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> tuple[int, str] | None:
    """The host memory this process may use: the smallest memory limit set on its cgroup or any above it (v2 and
    v1), and the machine's memory, with the file that set it; None when nothing plausible could be read."""
    v2, v1 = cgroup_paths(_read(proc / "self" / "cgroup"))
    found: list[tuple[int, str]] = []
    for mount in (cgroup_root, cgroup_root / "unified"):  # v2 alone, or beside v1 (hybrid)
        for directory in _chain(mount, v2):
            limit = _limit(_read(directory / "memory.max"))
            if limit is not None:
                found.append((limit, "cgroup v2 memory.max"))
    for directory in _chain(cgroup_root / "memory", v1):
        limit = _limit(_read(directory / "memory.limit_in_bytes"))
        if limit is not None:
            found.append((limit, "cgroup v1 memory.limit_in_bytes"))
    total = mem_total(_read(proc / "meminfo"))
    if total is not None:
        found.append((total, "/proc/meminfo MemTotal"))
    return min(found, key=lambda f: f[0]) if found else None


def host_memory_budget(given_bytes: float | None, proc: Path = Path("/proc"),
                       cgroup_root: Path = Path("/sys/fs/cgroup")) -> HostMemory | None:
    """The budget of the host-memory tiers: ``given_bytes`` (the user's) when given, else the host's limit less
    ``RESERVE_FRACTION``; None when neither is known."""
    if given_bytes is not None:
        return HostMemory(float(given_bytes), "option")
    limit = host_memory_limit(proc, cgroup_root)
    if limit is None:
        return None
    value, source = limit
    return HostMemory(value * (1.0 - RESERVE_FRACTION), f"{source}, less {RESERVE_FRACTION:.0%}")


__all__ = ["PLAUSIBLE_BYTES", "RESERVE_FRACTION", "HostMemory", "cgroup_paths", "host_memory_budget",
           "host_memory_limit", "mem_total"]
