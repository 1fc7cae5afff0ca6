"""How much a piece of code adds to a process's peak memory, measured in a fresh interpreter: its imports and
set-up run first, then the peak (``VmHWM`` in ``/proc/self/status``) is reset to the current RSS
(``/proc/self/clear_refs``) and the code runs; the growth of the peak over the RSS it started from is what the
code cost at its worst."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from tests.support.helpers import clean_env

_TEMPLATE = """
import json, sys
{imports}

def _status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024

args = json.loads(sys.argv[1])
outcomes = []
{setup}
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM starts again from VmRSS
_rss = _status("VmRSS")
{body}
print(json.dumps({{"grew_mib": _status("VmHWM") - _rss, "outcomes": outcomes}}))
"""


def peak_growth(imports: str, body: str, args: Any, *, setup: str = "", timeout: float = 120) -> dict[str, Any]:
    """Run ``body`` (which appends what it found to ``outcomes`` and may read ``args``, passed as JSON) after
    ``imports`` and ``setup`` (not measured: e.g. a first request, which sets up a client) in a fresh
    interpreter with this process's environment (an emulator's variables included):
    ``{"grew_mib": float, "outcomes": [...]}``."""
    script = _TEMPLATE.format(imports=imports, setup=setup, body=body)
    done = subprocess.run([sys.executable, "-c", script, json.dumps(args)], env=clean_env(),
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"[peak rss] {result}")
    return result


__all__ = ["peak_growth"]
