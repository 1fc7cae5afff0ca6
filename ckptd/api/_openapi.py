"""The app's OpenAPI schema, completed: what every route can answer and what it does; and the schema held to.

* ``document_errors``: the ``{job}`` path parameter's pattern (a name that fails it gets
  ``400 INVALID_JOB_NAME``), and the ``ErrorBody`` of every error status a route can give (401 without the
  token, 413, 415 for a body that is not JSON, 422, 500, ...), so clients and schema-driven tests
  (schemathesis) know them.
* ``reject_undeclared_query``: a ``/v1`` request naming a query parameter its operation does not declare is
  refused (``422 INVALID_REQUEST``), not silently ignored: ``?kind=`` on a route without it, or a typo, would
  otherwise answer as if it had been applied. So is a single parameter given twice, and a number or boolean
  not spelled as JSON. The probes, ``/metrics`` and the dashboard ignore queries.
* ``ROUTE_DOCS``: one-line summaries and short descriptions of the routes, used by the routers
  (``route_doc``); ``/docs``, ``/openapi.json`` and the generated reference (docs/api.md,
  ``python -m ckptd.api._gen_docs``) show them. A route's own docstring wins over the description here.
"""

from __future__ import annotations

import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.routing import compile_path

from trainer_client.core import protocol as p

ROUTE_DOCS: dict[tuple[str, str], tuple[str, str]] = {
    ("GET", p.ROUTE_HEALTHZ): ("Liveness", "200 while the process serves HTTP and its handler threads make progress; "
                               "503 `wedged` once none has freed up for `CKPTD_WEDGED_AFTER_S` (liveness probe)."),
    ("GET", p.ROUTE_READYZ): ("Readiness", "200 once the catalog has been built from storage, 503 before "
                              "(readiness probe); `detail` has the root, the last refresh and the last error, "
                              "for a caller with the token when one is configured (else it is empty)."),
    ("GET", p.ROUTE_METRICS): ("Prometheus metrics", "Prometheus text format; open without a token unless "
                             "`CKPTD_METRICS_REQUIRE_TOKEN` is set."),
    ("GET", p.ROUTE_JOBS): ("List jobs", "The jobs of the root (its subdirectories with a valid job name)."),
    ("GET", p.ROUTE_CHECKPOINTS): ("List a job's steps", "Every step directory of the job with its state."),
    ("GET", p.ROUTE_LATEST_GOOD): ("Latest good step", "The newest verified, non-quarantined step, checked on "
                                   "storage before it is named; 404 `NO_GOOD_CHECKPOINT` when the job has no "
                                   "committed step, 503 `NOT_READY` while its committed steps are being verified."),
    ("POST", p.ROUTE_RESUME): ("Resume plan", "Where to resume and how to lay the state out on the devices alive "
                               "now: step, path, mesh, partition specs, batch and data position."),
    ("GET", p.ROUTE_ADVICE): ("Goodput advisor", ""),
    ("POST", p.ROUTE_EVENTS): ("Report events", ""),
    ("GET", p.ROUTE_EVENTS): ("Read events", ""),
    ("GET", p.ROUTE_GOODPUT): ("Goodput", ""),
    ("POST", p.ROUTE_PEER_FETCH): ("Part back from a peer", "A multi-host job's trainer whose host memory was wiped "
                                   "asks its host's ckptd to bring its part of a step back from another host's "
                                   "copy (docs/multihost.md, \"Peer copies\"); answered once the part is back, every "
                                   "shard checked, or the fetch failed (`ok: false`, why: restore from storage). "
                                   "409 `PEER_CHANNEL_OFF` when this ckptd's peer channel is off."),
    ("GET", p.ROUTE_DASHBOARD): ("Dashboard", ""),
}


def route_doc(method: str, path: str) -> dict[str, Any]:
    """The ``summary`` (and ``description``, when the table has one) to pass to a route decorator."""
    summary, description = ROUTE_DOCS[(method, path)]
    return {"summary": summary, **({"description": description} if description else {})}


_ERROR_REF = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}
_ANY_ROUTE = (413, 500)  # a body over the limit; a bug (never the caller's mistake, still the error body)
_V1_ROUTE = (401, 404, 422, 503)  # no or a wrong token; unknown job; bad input; catalog not ready / storage
_JOB_ROUTE = (400,)  # the {job} segment is not a job name


def _describe(status: int) -> str:
    codes = sorted(c.value for c, s in p.ERROR_STATUS.items() if s == status)
    return "Error: " + ", ".join(codes) if codes else "Error"


def document_errors(app: FastAPI, *, metrics_require_token: bool = False) -> None:
    """Complete the OpenAPI schema of ``app`` (once, when it is first generated): the job-name pattern on
    every ``{job}`` parameter, and an ``ErrorBody`` response for every error status a route can give."""
    generate = app.openapi
    documented: list[dict[str, Any]] = []

    def openapi() -> dict[str, Any]:
        schema = generate()  # FastAPI caches it in app.openapi_schema: the same dict until that is reset
        if documented and documented[-1] is schema:
            return schema
        schema.setdefault("components", {}).setdefault("schemas", {}).setdefault(
            "ErrorBody", p.ErrorBody.model_json_schema(ref_template="#/components/schemas/{model}")
        )
        for path, item in schema.get("paths", {}).items():
            for operation in item.values():
                if not isinstance(operation, dict) or "responses" not in operation:
                    continue
                statuses = list(_ANY_ROUTE)
                if path.startswith(p.API_PREFIX):
                    statuses += _V1_ROUTE
                if path == p.ROUTE_METRICS and metrics_require_token:
                    statuses.append(401)
                for param in operation.get("parameters", []):
                    if param.get("in") == "path" and param.get("name") == "job":
                        param.setdefault("schema", {}).update(pattern=p.JOB_NAME_PATTERN, maxLength=128)
                        statuses += _JOB_ROUTE
                if "requestBody" in operation:
                    statuses.append(415)  # a body without Content-Type: application/json
                for status in statuses:
                    operation["responses"].setdefault(
                        str(status), {"description": _describe(status), "content": _ERROR_REF}
                    )
        documented[:] = [schema]
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


# How a query value must be spelled, by its schema type: as JSON writes it (pydantic would also take " 32",
# "1_000", "inf" or "on", which the schema does not allow and a typo may produce).
_SPELLING = {
    "integer": re.compile(r"-?(?:0|[1-9][0-9]*)"),
    "number": re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"),
    "boolean": re.compile(r"true|false"),
}


def _query_param(schema: dict[str, Any]) -> tuple[bool, str | None]:
    """(repeatable, scalar type) of a query parameter's schema (``anyOf`` with null for optional ones)."""
    branches = [b for b in schema.get("anyOf", [schema]) if b.get("type") != "null"]
    for branch in branches:
        if branch.get("type") == "array":
            return True, branch.get("items", {}).get("type")
    return False, branches[0].get("type") if len(branches) == 1 else None


def declared_query(app: FastAPI) -> dict[tuple[str, str], dict[str, tuple[bool, str | None]]]:
    """(method, path template) -> {query parameter: (repeatable, scalar type)}, from the app's own schema."""
    table: dict[tuple[str, str], dict[str, tuple[bool, str | None]]] | None = getattr(app.state, "declared_query",
                                                                                       None)
    if table is None:
        table = {
            (method.upper(), path): {q["name"]: _query_param(q.get("schema", {}))
                                     for q in op.get("parameters", []) if q.get("in") == "query"}
            for path, item in app.openapi().get("paths", {}).items()
            for method, op in item.items() if isinstance(op, dict)
        }
        app.state.declared_query = table
    return table


def methods_of_path(app: FastAPI, path: str) -> set[str]:
    """Every method the app's schema declares for the operations whose template matches ``path`` (HEAD with
    GET, as Starlette serves it): what a 405's ``Allow`` must list."""
    templates: list[tuple[re.Pattern[str], frozenset[str]]] | None = getattr(app.state, "path_methods", None)
    if templates is None:
        templates = []
        for template, item in app.openapi().get("paths", {}).items():
            methods = {m.upper() for m, op in item.items() if isinstance(op, dict)}
            if "GET" in methods:
                methods.add("HEAD")
            templates.append((compile_path(template)[0], frozenset(methods)))
        app.state.path_methods = templates
    return {m for pattern, methods in templates if pattern.match(path) for m in methods}


async def reject_undeclared_query(request: Request) -> None:
    """App-wide dependency (``FastAPI(dependencies=...)``): hold a ``/v1`` request's query to its operation's
    schema; each parameter not declared, a single one given twice (FastAPI would keep the last), or a number or
    boolean not spelled as JSON is named in the error body."""
    if not request.query_params:
        return
    path = getattr(request.scope.get("route"), "path", "")
    if not path.startswith(p.API_PREFIX):
        return
    method = "GET" if request.method == "HEAD" else request.method
    declared = declared_query(request.app).get((method, path))
    if declared is None:
        return
    errors: list[dict[str, Any]] = []
    for name in sorted(set(request.query_params)):
        values = request.query_params.getlist(name)
        if name not in declared:
            errors.append({"type": "extra_forbidden", "loc": ("query", name),
                           "msg": "not a parameter of this operation"})
            continue
        repeatable, kind = declared[name]
        if len(values) > 1 and not repeatable:
            errors.append({"type": "too_long", "loc": ("query", name), "msg": "given more than once"})
        spelling = _SPELLING.get(kind or "")
        if spelling is not None and not all(spelling.fullmatch(v) for v in values):
            errors.append({"type": f"{kind}_parsing", "loc": ("query", name), "msg": f"not a JSON {kind}"})
    if errors:
        raise RequestValidationError(errors)


__all__ = ["ROUTE_DOCS", "declared_query", "document_errors", "methods_of_path", "reject_undeclared_query",
           "route_doc"]
