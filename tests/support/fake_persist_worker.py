"""A stand-in persist worker child for tests of ``ckptd.persist._worker_client``: reads the same request lines as
``python -m ckptd.persist._persist_worker --serve`` (and its flags) and misbehaves as the request's ``snapshot``
says: ``die`` exits, ``nonsense`` answers a line that is no answer, ``hang`` never answers, ``damaged`` and
``fail`` answer the failures the worker gives, ``platform`` answers the ``JAX_PLATFORMS`` it was started with as its
path; anything else is persisted to ``<job_url>/<pid>``."""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> int:
    for line in sys.stdin:
        request = json.loads(line)
        what = request.get("snapshot")
        if what == "die":
            return 3
        if what == "nonsense":
            print("hello", flush=True)
        elif what == "hang":
            time.sleep(60)
        elif what == "damaged":
            print(json.dumps({"ok": False, "error": "StoredFormatError: bad bytes", "failure": "damaged"}), flush=True)
        elif what == "fail":
            print(json.dumps({"ok": False, "error": "OSError: disk full", "failure": "failed"}), flush=True)
        elif what == "platform":
            print(json.dumps({"ok": True, "path": os.environ.get("JAX_PLATFORMS", "")}), flush=True)
        else:
            print(json.dumps({"ok": True, "path": f"{request['job_url']}/{os.getpid()}"}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
