#!/usr/bin/env bash
# Each install role in a fresh virtual environment, and the commands that role has (docs/getting-started.md):
# `pip install ckptd` (base: the CLI, the client), `ckptd[server]` (ckptd serve answers /healthz), `ckptd[trainer]`
# (the jax names). The tests run each role in one interpreter with the other roles' libraries blocked
# (tests/system/test_install_roles.py); this installs them for real, as a user does. Run by .ci/run before make test.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TMP=$(mktemp -d "${TMPDIR:-/tmp}/ckptd-roles.XXXXXX")
SERVER_PID=""
cleanup() {
  [ -n "$SERVER_PID" ] && kill "$SERVER_PID" 2>/dev/null && wait "$SERVER_PID" 2>/dev/null
  rm -rf "$TMP"
}
trap cleanup EXIT

venv() {  # venv ROLE SPEC: a fresh virtual environment under $TMP with SPEC installed from this checkout
  echo "== role $1: pip install '$2' into a fresh venv"
  "$PYTHON" -m venv "$TMP/$1"
  "$TMP/$1/bin/python" -m pip install --quiet --disable-pip-version-check "$2" \
    2> >(grep -v "is ignored: it is neither" >&2)  # this machine's pip configuration names absent indexes
}

# A small root: job `demo`, step 10 committed (what Orbax writes, without arrays).
ROOT="$TMP/root"
mkdir -p "$ROOT/demo/10/default"
echo '{"item_handlers": {"default": "x"}, "commit_timestamp_nsecs": 1700000000000000000}' \
  > "$ROOT/demo/10/_CHECKPOINT_METADATA"
echo '{}' > "$ROOT/demo/10/default/_METADATA"
echo ok > "$ROOT/demo/10/commit_success.txt"

venv base "$PWD"
B="$TMP/base/bin"
"$B/ckptd" --help > /dev/null
"$B/ckptd" --version
"$B/ckptd" ls "$ROOT" | tee "$TMP/ls.txt"
grep -q '^demo ' "$TMP/ls.txt"
"$B/python" -c "from trainer_client import CkptdClient, ClientSettings; print('base: CkptdClient imports')"
if "$B/ckptd" serve --root "$ROOT" 2> "$TMP/serve.err"; then
  echo "base: ckptd serve started without the server's libraries" >&2; exit 1
fi
grep -q "pip install 'ckptd\[server\]'" "$TMP/serve.err" && echo "base: $(cat "$TMP/serve.err")"

venv server "$PWD[server]"
PORT=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$TMP/server/bin/ckptd" serve --root "$ROOT" --port "$PORT" --state-dir "$TMP/state" > "$TMP/serve.log" 2>&1 &
SERVER_PID=$!
"$PYTHON" - "$PORT" <<'EOF' || { cat "$TMP/serve.log" >&2; exit 1; }
import sys, time, urllib.request
deadline = time.monotonic() + 90
while True:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/healthz", timeout=2) as answer:
            print("server: /healthz", answer.status)
            break
    except OSError:
        if time.monotonic() > deadline:
            sys.exit("server: ckptd serve did not answer /healthz within 90 s")
        time.sleep(0.5)
EOF
grep "serving the checkpoint root" "$TMP/serve.log"
kill "$SERVER_PID" && wait "$SERVER_PID" || true
SERVER_PID=""

venv trainer "$PWD[trainer]"
XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu "$TMP/trainer/bin/python" - <<'EOF'
import trainer_client
from trainer_client import Checkpointer, ElasticConfig, ElasticRunner, PathwaysSlices, SimulatedSlices

print("trainer:", len(SimulatedSlices(num_slices=4).slice_to_devices), "simulated slices;",
      ", ".join(n for n in ("Checkpointer", "ElasticConfig", "ElasticRunner") if getattr(trainer_client, n)))
try:
    PathwaysSlices()
except ValueError as exc:
    assert "SimulatedSlices" in str(exc), exc
    print("trainer: PathwaysSlices() on CPU:", exc)
else:
    raise SystemExit("PathwaysSlices() on CPU did not say what to use instead")
EOF
echo "== roles: all three work"
