"""Plain helpers the tests share: free ports, polling, a clean environment for subprocesses, settings."""

from __future__ import annotations

import mmap
import os
import resource
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from bench.common import stop_process  # SIGTERM, wait, SIGKILL: one copy, the benchmarks' (bench never imports tests)
from ckptd.config import Settings

T = TypeVar("T")

REPO = Path(__file__).resolve().parents[2]  # the repository root: importable by every subprocess a test starts


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(
    probe: Callable[[], T | None], *, timeout: float = 10.0, interval: float = 0.05, what: str = "condition"
) -> T:
    """Call ``probe`` until it returns something truthy; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while True:
        last = probe()
        if last:
            return last
        if time.monotonic() >= deadline:
            pytest.fail(f"timed out after {timeout:.1f}s waiting for {what} (last: {last!r})")
        time.sleep(interval)


class SteppingClock:
    """A clock that moves ``step_s`` at each reading: a deadline passes after a known number of looks, however
    fast or slow the machine does the work between them (a real clock made tests fail where the work beat its
    deadline). ``reads``: how many looks so far."""

    def __init__(self, step_s: float) -> None:
        self.now, self.step_s, self.reads = 0.0, step_s, 0

    def __call__(self) -> float:
        self.now += self.step_s
        self.reads += 1
        return self.now


def clean_env(**extra: str) -> dict[str, str]:
    """The current environment without any CKPTD_* variable (but the tests' own ``CKPTD_TEST_DEVICE``: a child
    runs on unix sockets too), plus ``extra``; 8 fake CPU devices; the repository importable (``tests.support``
    included)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTD_") or k == "CKPTD_TEST_DEVICE"}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra)
    return env


def minor_faults() -> int:
    """This process's minor page faults so far."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def kernel_counts_page_faults() -> bool:
    """Whether this kernel counts a process's page faults and resident pages as Linux does (gVisor's reports no
    minor faults, and its resident size does not follow the pages a process touches): tests that read either
    skip where it does not."""
    before = minor_faults()
    with mmap.mmap(-1, 64 * mmap.PAGESIZE) as pages:
        for offset in range(0, len(pages), mmap.PAGESIZE):
            pages[offset] = 1
    return minor_faults() - before >= 32


def make_settings(root: str | Path, state_dir: str | Path, **overrides: Any) -> Settings:
    """Settings with every field pinned, so no CKPTD_* variable of the caller's shell leaks in."""
    values: dict[str, Any] = {
        "root": str(root),
        "host": "127.0.0.1",
        "port": 0,
        "token": None,
        "token_file": None,
        "state_dir": str(state_dir),
        "refresh_interval_s": 0.2,
        "save_timeout_s": 3600.0,
        "log_level": "warning",
        "keep_last": None,
        "keep_every": None,
        "keep_newer_than_s": None,
        "clean_abandoned": True,
        "gc_interval_s": 300.0,
        "adopt_after_s": 0.0,  # tests write plain-Orbax steps and look at once
        "metrics_require_token": False,
        "max_body_bytes": 8 << 20,
        "worker_threads": 8,
        "read_only": False,
        "read_only_jobs": "",
    }
    values.update(overrides)
    return Settings(**values)


def tree_from_leaf_names(flat: dict[str, Any]) -> Any:
    """A nested tree from Orbax's dotted leaf names (digit keys make lists, as the state had them): a restore
    target built from a plan's arrays."""
    tree: dict[str, Any] = {}
    for name, leaf in flat.items():
        *parents, last = name.split(".")
        node = tree
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = leaf

    def lists(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        if node and all(k.isdigit() for k in node):
            return [lists(node[str(i)]) for i in range(len(node))]
        return {k: lists(v) for k, v in node.items()}

    return lists(tree)


__all__ = ["REPO", "clean_env", "free_port", "kernel_counts_page_faults", "make_settings", "minor_faults",
           "stop_process", "tree_from_leaf_names", "wait_until"]
