"""The host memory one restore holds: ``restore_peak_host_rss_ratio_vs_state``.

Each restore runs in a child process of its own (``python -m bench.restore_rss``), so that one restore's
peak never hides in another's and nothing the parent holds counts: the child imports jax, Orbax and
trainer_client, builds the target (``ShapeDtypeStruct`` leaves of the io state's layout), reads its resident
set size (the baseline), resets the kernel's high-water mark (``/proc/self/clear_refs`` = 5), restores, and
reads the high-water mark (``VmHWM``). Peak above the baseline ÷ the state's bytes is the figure. On
these fake CPU devices the restored arrays themselves live in host memory, so a restore that makes no
copy scores about 1.0; everything above it is what the restore held besides its result.

After the peak is read the child hashes the restored bytes (SHA-256 over every array's shards in row
order), so a test can check the restore was exact.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import hashlib
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PyTree = Any


def _status_kib(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    if match is None:
        raise RuntimeError(f"/proc/self/status has no {field}")
    return int(match.group(1))


def rss_bytes() -> int:
    return _status_kib("VmRSS") * 1024


def reset_peak() -> None:
    """Make the kernel's peak RSS (VmHWM) start again from the current RSS."""
    Path("/proc/self/clear_refs").write_text("5\n")


def peak_reset_problem() -> str | None:
    """Why this machine cannot reset the peak RSS (a sandbox such as gVisor refuses ``clear_refs``), or None."""
    try:
        reset_peak()
    except OSError as e:
        return f"this kernel does not let a process reset its peak RSS (/proc/self/clear_refs: {e.strerror})"
    return None


def peak_bytes() -> int:
    return _status_kib("VmHWM") * 1024


def digest(tree: PyTree) -> str:
    """SHA-256 over every array's bytes: its shards in index order (one replica each)."""
    import jax
    import numpy as np

    h = hashlib.sha256()
    for leaf in jax.tree_util.tree_leaves(tree):
        shards = sorted((s for s in leaf.addressable_shards if s.replica_id == 0),
                        key=lambda s: tuple(sl.start or 0 for sl in s.index))
        for s in shards:
            h.update(np.ascontiguousarray(np.asarray(s.data)).reshape(-1).view(np.uint8).data)
    return h.hexdigest()


def _child(args: argparse.Namespace) -> dict[str, Any]:
    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from trainer_client.runtime.saving._checkpointing import restore

    mesh = Mesh(np.array(jax.devices()[: args.devices]), ("data",))
    sharding = NamedSharding(mesh, PartitionSpec("data", None))
    target = {"params": {f"layer{i}": jax.ShapeDtypeStruct((args.rows, args.cols), np.float32, sharding=sharding)
                         for i in range(args.arrays)}}
    step_dir = Path(args.step_dir)
    baseline = rss_bytes()
    reset_peak()
    started = time.perf_counter()
    if args.mode == "orbax":
        mgr = ocp.CheckpointManager(str(step_dir.parent))
        try:
            out = mgr.restore(int(step_dir.name), args=ocp.args.StandardRestore(target))
        finally:
            mgr.close()
    else:
        out = restore(str(step_dir), target, direct=args.mode == "ckptd", host_bytes=args.cap)
    jax.block_until_ready(out)
    seconds = time.perf_counter() - started
    peak = peak_bytes()
    return {"mode": args.mode, "cap": args.cap, "baseline_bytes": baseline, "peak_above_bytes": peak - baseline,
            "seconds": seconds, "digest": digest(out) if args.digest else None}


def measure(step_dir: Path, mode: str, *, arrays: int, rows: int, cols: int, devices: int = 8,
            cap: int | None = None, digest: bool = False, env: dict[str, str] | None = None,
            timeout: float = 1200.0) -> dict[str, Any]:
    """One restore of ``step_dir`` in a fresh child process: its peak RSS above its baseline and more.

    ``mode``: ``ckptd`` (``checkpointing.restore``), ``ckptd-orbax`` (the same with ``direct=False``: its
    Orbax path) or ``orbax`` (plain ``CheckpointManager.restore``); ``cap``: the restore's ``host_bytes``;
    ``env``: the child's environment (default: this one's)."""
    cmd = [sys.executable, "-m", "bench.restore_rss", str(step_dir), mode, "--arrays", str(arrays), "--rows",
           str(rows), "--cols", str(cols), "--devices", str(devices)]
    if cap is not None:
        cmd += ["--cap", str(cap)]
    if digest:
        cmd.append("--digest")
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"restore child ({mode}) failed: {done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("step_dir")
    parser.add_argument("mode", choices=["ckptd", "ckptd-orbax", "orbax"])
    parser.add_argument("--arrays", type=int, required=True)
    parser.add_argument("--rows", type=int, required=True)
    parser.add_argument("--cols", type=int, required=True)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--cap", type=int, default=None)
    parser.add_argument("--digest", action="store_true")
    print(json.dumps(_child(parser.parse_args(argv))), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
