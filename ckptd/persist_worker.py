"""``python -m ckptd.persist_worker SNAPSHOT_DIR JOB_URL``: write one host-memory snapshot to storage.

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
    state = jax.tree_util.tree_unflatten(treedef, global_arrays(snapshot))
    checkpointer = Checkpointer(job_url, compression=compression)
    try:
        checkpointer.save_with_metadata(meta.step, state, meta.training)
        checkpointer.wait()
    finally:
        checkpointer.close()
    return f"{job_url.rstrip('/')}/{meta.step}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("snapshot")
    parser.add_argument("job_url")
    parser.add_argument("--compression", action="store_true")
    args = parser.parse_args(argv)
    try:
        print(persist(Path(args.snapshot), args.job_url, compression=args.compression), flush=True)
    except Exception as exc:  # reported to the parent through stderr and the exit code
        print(f"persist failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
