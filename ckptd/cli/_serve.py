"""``ckptd serve``: the HTTP API under uvicorn, started only once it can serve.

Before anything runs, what would make the server useless is refused with one line on stderr and a
non-zero exit, never a traceback and never after "startup complete": invalid settings (exit 2), a local
root that does not exist (exit 2; ``--create-root`` creates it, with a warning) or is no readable
directory, a port that cannot be bound (exit 1: the socket is bound here, before uvicorn starts the
application), a unix socket (``--uds PATH``, ``CKPTD_UDS``: instead of host and port) that may not be
listened on (exit 1: a path that is no socket, a live one, an unsafe directory: ckptd/cli/_unix_listener.py).
Listening beyond loopback without a token is allowed (the container image does it) but warned about loudly.
``--help`` lists every setting in its group (``ckptd.config.GROUPS``, as docs/operations.md "Settings" does):
the flags, each with its variable and default, and the settings only the environment sets. Once it answers, it
logs where (``serving_line``: the root, the URL with the port bound or the socket, the dashboard, ``/docs``,
``/metrics``). In the base install, without the server's libraries, it says which install has them
(``pip install 'ckptd[server]'``).
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import socket
import sys
import textwrap
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from ckptd.catalog._settings import StorageSettings
from ckptd.cli._serve_settings import ServeSettings
from ckptd.cli._unix_listener import bind_unix, identity, release
from ckptd.config import GROUPS, Settings, env_names
from trainer_client.core import UDS_BASE_URL, needs_extra, unix_url

EXIT_OK = 0
EXIT_BAD = 1
EXIT_USAGE = 2
SWITCH_INTERVAL_S = 0.001

_log = logging.getLogger("ckptd.serve")

# flag -> setting; every flag overrides the CKPTD_ variable of the same name
_FLAGS = {"--root": "root", "--host": "host", "--port": "port", "--uds": "uds", "--uds-mode": "uds_mode",
          "--state-dir": "state_dir", "--shm-dir": "shm_dir", "--lease-ttl-s": "lease_ttl_s"}
_SWITCHES = {"--create-root": "create_root", "--read-only": "read_only"}  # flags without a value: true


def _default(name: str) -> str:
    default = Settings.setting_fields()[name].default
    return "unset" if default is None else "empty" if default == "" else str(default)


def _help(name: str) -> str:
    """The setting's description, its variable and its default, for ``serve --help``."""
    description = Settings.setting_fields()[name].description or ""
    text = f"{description} (env {env_names(name)[0]}"
    if "default" not in description:
        text += f"; default: {_default(name)}"
    return text.replace("%", "%%") + ")"


def _group_help(group: str) -> str:
    """What a group's heading says in ``serve --help``: what the group is for, then each setting only the
    environment sets, one a line."""
    cls = GROUPS[group]
    flagged = {*_FLAGS.values(), *_SWITCHES.values()}
    lines = [" ".join((cls.__doc__ or "").replace("``", "`").split())]
    only_env = [f"  {' or '.join(env_names(name))} (default: {_default(name)}): {info.description}"
                for name, info in cls.model_fields.items() if name not in flagged]
    lines += ["from the environment only:", *only_env] if only_env else []
    return "\n".join(lines).replace("%", "%%")


class _GroupedHelp(argparse.HelpFormatter):
    """Descriptions keep their lines, each wrapped on its own: a group's settings stand one a line."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        out = []
        for line in text.splitlines():
            body = line.lstrip()
            lead = indent + line[: len(line) - len(body)]
            more = "    " if len(lead) > len(indent) else ""  # a setting's line: its continuation indented
            out.append(textwrap.fill(body, width, initial_indent=lead, subsequent_indent=lead + more))
        return "\n".join(out)


def add_parser(sub: Any) -> None:
    """``ckptd serve`` on the CLI's subcommand parsers."""
    serve = sub.add_parser(
        "serve", help="serve the HTTP API (settings: flags, else CKPTD_* variables)", formatter_class=_GroupedHelp,
        description="Serve the HTTP API until SIGTERM or SIGINT. Each flag overrides its CKPTD_* variable; every "
        "other setting comes from the environment: all of them are listed below by group (docs/operations.md, "
        "\"Settings\"). A local root "
        "must exist, the port must be free: otherwise one line on stderr and exit 2 or 1. With --uds PATH it listens "
        "on a unix socket instead of host:port (trainers: CKPTD_URL=unix:///PATH): the socket's mode (0600, or "
        "0660 with --uds-mode) is who may connect, in a directory of this user's that others may not write; a "
        "stale socket is replaced, a live one or any other file is refused (exit 1).")
    sections = {group: serve.add_argument_group(group.replace("_", " "), _group_help(group)) for group in GROUPS}
    for flag, name in _FLAGS.items():
        sections[Settings.group_of(name)].add_argument(flag, type=int if name == "port" else str, help=_help(name),
                                                       metavar={"uds": "PATH", "uds_mode": "MODE"}.get(name))
    for flag, name in _SWITCHES.items():
        sections[Settings.group_of(name)].add_argument(flag, action="store_true", default=None, help=_help(name))
    serve.set_defaults(func=run)


def _fail(message: str, code: int) -> int:
    print(f"ckptd: {message}", file=sys.stderr)
    return code


def _check_root(storage: StorageSettings) -> str | None:
    """Why a local root cannot be served (``None``: it can; a ``gs://`` root is the catalog's to check)."""
    if "://" in storage.root:
        return None
    root = Path(storage.root)
    if not root.exists() and not root.is_symlink():
        if not storage.create_root:
            return (f"the checkpoint root {storage.root!r} does not exist: create it, or pass --create-root "
                    "(CKPTD_CREATE_ROOT=true)")
        try:
            root.mkdir(parents=True)
        except OSError as exc:
            return f"cannot create the checkpoint root {storage.root!r}: {exc.strerror or exc}"
        _log.warning("created the checkpoint root %s (it did not exist)", root.resolve())
    if not root.is_dir():
        return f"the checkpoint root {storage.root!r} is not a directory"
    if not os.access(root, os.R_OK | os.X_OK):
        return f"the checkpoint root {storage.root!r} cannot be listed by this user"
    return None


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: whatever it resolves to, assume the network


def _bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound now: a port in use is an error before the application starts."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def _listen(serve: ServeSettings, token: str | None) -> socket.socket:
    """The listening socket: the unix socket ``serve.uds`` (``ValueError``: why not, in one line), else
    ``host:port`` (``OSError``), warned about when it is beyond loopback without a ``token``."""
    if serve.uds is not None:
        return bind_unix(serve.uds, serve.socket_mode())
    if token is None and not _is_loopback(serve.host):
        _log.warning("NO TOKEN: listening on %s without a bearer token, so anyone who can reach port %d can list "
                     "jobs, read plans and post events; set CKPTD_TOKEN_FILE or CKPTD_TOKEN (docs/operations.md, "
                     "Security)", serve.host, serve.port)
    return _bind(serve.host, serve.port)


def serving_line(settings: Settings, sock: socket.socket) -> str:
    """Where the server answers, for its log: the root, the URL (the port bound, when 0 was asked for; a unix
    socket's ``unix://`` URL and mode) and the pages a person opens there."""
    root, mode = settings.storage.root, ", read-only" if settings.storage.read_only else ""
    if sock.family == socket.AF_UNIX:
        path = sock.getsockname()
        return (f"serving the checkpoint root {root}{mode} at {unix_url(path)} (mode {settings.serve.uds_mode}): "
                f"curl --unix-socket {path} {UDS_BASE_URL}/healthz; dashboard /, API docs /docs, metrics /metrics")
    host, port = sock.getsockname()[:2]
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    return (f"serving the checkpoint root {root}{mode} at {url}: dashboard {url}/, API docs {url}/docs, "
            f"metrics {url}/metrics")


def run(args: argparse.Namespace) -> int:
    """``ckptd serve``: check, bind, then serve until SIGTERM/SIGINT."""
    with needs_extra("server", "ckptd serve"):  # the base install has the CLI, not the server's libraries
        import uvicorn

        from ckptd._sidecar import build_sidecar
        from ckptd.api._app import create_app
        from ckptd.api._connections import server_config

    overrides = {name: value for name in [*_FLAGS.values(), *_SWITCHES.values()]
                 if (value := getattr(args, name, None)) is not None}
    try:
        settings = Settings(**overrides)
    except ValidationError as exc:  # e.g. an unreadable CKPTD_TOKEN_FILE: one clear line, no traceback
        for err in exc.errors():
            where = ".".join(str(x) for x in err["loc"])
            print(f"ckptd: invalid settings: {where + ': ' if where else ''}{err['msg']}", file=sys.stderr)
        return EXIT_USAGE
    serve = settings.serve
    # ckptd's own loggers (persists, quarantines, refresh failures) at the same level as uvicorn's
    level = 5 if serve.log_level.lower() == "trace" else serve.log_level.upper()  # uvicorn's own level
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if serve.uds is not None and (getattr(args, "host", None), getattr(args, "port", None)) != (None, None):
        return _fail("--uds replaces --host and --port: give the socket or the address, not both", EXIT_USAGE)
    problem = _check_root(settings.storage)
    if problem is not None:
        return _fail(problem, EXIT_USAGE)
    try:
        sock = _listen(serve, settings.auth.token)
    except ValueError as exc:  # the unix socket's refusals, one line each
        return _fail(str(exc), EXIT_BAD)
    except OSError as exc:
        return _fail(f"cannot listen on {serve.host}:{serve.port}: {exc.strerror or exc}", EXIT_BAD)
    bound = identity(serve.uds) if serve.uds is not None else None
    app = create_app(settings, sidecar=build_sidecar(settings))  # the composition root (ckptd/_sidecar.py)
    # Answers are short; background passes (refresh, metrics, persist bookkeeping) are long and CPU-bound.
    # A 1 ms GIL switch interval (Python's default is 5 ms) keeps a background pass from adding its whole
    # slice to every GIL hand-over of an answer.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    served = serving_line(settings, sock)

    class Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets=sockets)
            if self.started:  # said once it answers, not before (a failed startup says why instead)
                _log.info("%s", served)

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            try:
                await super().shutdown(sockets=sockets)
            finally:  # here, not after run(): uvicorn raises the SIGTERM it caught again once run() ends
                unbind()

    def unbind() -> None:
        """The socket file goes with the server (unless another server's took its place)."""
        if serve.uds is not None:
            release(serve.uds, bound)

    server = Server(server_config(app, settings))
    try:
        with sock:
            server.run(sockets=[sock])
    finally:
        unbind()
    return EXIT_OK if server.started else EXIT_BAD  # not started: the application's startup failed (logged)

__all__ = ["add_parser", "run", "serving_line"]
