"""One-line summaries and short descriptions of ckptd's routes, for the OpenAPI schema.

FastAPI takes a route's summary from its function name ("List Jobs") and its description from the
docstring; this table fills in the routes that have neither in a form an operator can use, so
``/docs``, ``/openapi.json`` and the generated reference (docs/api.md, ``ckptd.gen_api_docs``) say what
each route does. A route's own docstring wins over the description here.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.routing import APIRoute

from trainer_client import protocol as p

ROUTE_DOCS: dict[tuple[str, str], tuple[str, str]] = {
    ("GET", p.ROUTE_HEALTHZ): ("Liveness", "Always 200 while the process serves HTTP (liveness probe)."),
    ("GET", p.ROUTE_READYZ): ("Readiness", "200 once the catalog has been built from storage, 503 before "
                              "(readiness probe); `detail` has the root, the last refresh and the last error."),
    ("GET", p.ROUTE_METRICS): ("Prometheus metrics", "Prometheus text format; open without a token unless "
                             "`CKPTD_METRICS_REQUIRE_TOKEN` is set."),
    ("GET", p.ROUTE_JOBS): ("List jobs", "The jobs of the root (its subdirectories with a valid job name)."),
    ("GET", p.ROUTE_CHECKPOINTS): ("List a job's steps", "Every step directory of the job with its state."),
    ("GET", p.ROUTE_LATEST_GOOD): ("Latest good step", "The newest verified, non-quarantined step, checked on "
                                   "storage before it is named; 404 `NO_GOOD_CHECKPOINT` when there is none."),
    ("POST", p.ROUTE_RESUME): ("Resume plan", "Where to resume and how to lay the state out on the devices alive "
                               "now: step, path, mesh, partition specs, batch and data position."),
    ("GET", p.ROUTE_ADVICE): ("Goodput advisor", ""),
    ("POST", p.ROUTE_EVENTS): ("Report events", ""),
    ("GET", p.ROUTE_EVENTS): ("Read events", ""),
    ("GET", p.ROUTE_GOODPUT): ("Goodput", ""),
    ("GET", p.ROUTE_DASHBOARD): ("Dashboard", ""),
}


def describe_routes(app: FastAPI) -> None:
    """Set the summary (and a missing description) of every route listed in ``ROUTE_DOCS``."""
    for route in app.routes:
        if not isinstance(route, APIRoute):
            continue
        for method in route.methods or ():
            doc = ROUTE_DOCS.get((method, route.path))
            if doc is None:
                continue
            summary, description = doc
            route.summary = route.summary or summary
            if description and not route.description:
                route.description = description


__all__ = ["ROUTE_DOCS", "describe_routes"]
