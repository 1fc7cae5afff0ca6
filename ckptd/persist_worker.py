"""``python -m ckptd.persist_worker [--serve | SNAPSHOT_DIR JOB_URL]``: write host-memory snapshots to storage.

Runs as a child process of ckptd, because writing Orbax's layout takes Orbax, and Orbax takes jax —
which ckptd's own process never imports. The child uses jax on the CPU only (it must never claim the
host's accelerators), assembles each array from the snapshot's memory map, and saves the state through
trainer_client's Checkpointer: Orbax's layout, the manifest written before the commit marker, fsynced.
Plain Orbax can restore the result. It prints the committed step's URL; a non-zero exit means the step
was not committed.
"""

from __future__ import annotations

import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"  # never the host's accelerators

import argparse
import json
import pickle
from pathlib import Path

import jax

from trainer_client.checkpointing import Checkpointer
from trainer_client.snapshot_format import TREEDEF_FILE, global_arrays, problems, read_meta


def persist(snapshot: Path, job_url: str, *, compression: bool = False) -> str:
    bad = problems(snapshot)
    if bad:
        raise ValueError(f"snapshot {snapshot} is not whole: {'; '.join(bad)}")
    meta = read_meta(snapshot)
    treedef = pickle.loads((snapshot / TREEDEF_FILE).read_bytes())  # written by this job's own trainer
    # jax arrays, not numpy: Orbax writes jax arrays through its parallel array path, numpy leaves ~7x slower.
    state = jax.tree_util.tree_unflatten(treedef, [jax.device_put(a) for a in global_arrays(snapshot)])
    checkpointer = Checkpointer(job_url, compression=compression)
    try:
        checkpointer.save_with_metadata(meta.step, state, meta.training)
        checkpointer.wait()
    finally:
        checkpointer.close()
    return f"{job_url.rstrip('/')}/{meta.step}"


def serve(compression: bool) -> int:
    """Persist one snapshot per request line (``{"snapshot": DIR, "job_url": URL}``), answering one JSON
    line each (``{"ok": true, "path": URL}`` or ``{"ok": false, "error": ...}``) — so jax and Orbax are
    imported once, not once per snapshot."""
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            request = json.loads(line)
            path = persist(Path(request["snapshot"]), request["job_url"], compression=compression)
            answer: dict[str, object] = {"ok": True, "path": path}
        except Exception as exc:  # reported to the parent, which logs it and retries later
            answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(answer), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("snapshot", nargs="?")
    parser.add_argument("job_url", nargs="?")
    parser.add_argument("--compression", action="store_true")
    parser.add_argument("--serve", action="store_true", help="persist the snapshots named on stdin, one per line")
    args = parser.parse_args(argv)
    if args.serve:
        return serve(args.compression)
    if not args.snapshot or not args.job_url:
        parser.error("SNAPSHOT and JOB_URL are required without --serve")
    try:
        print(persist(Path(args.snapshot), args.job_url, compression=args.compression), flush=True)
    except Exception as exc:  # reported to the parent through stderr and the exit code
        print(f"persist failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
