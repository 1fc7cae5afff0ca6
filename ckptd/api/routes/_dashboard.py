"""``GET /``: the dashboard, one self-contained HTML page (no front-end build step, no external asset).

The page (``ckptd/api/static/dashboard.html``) is static: inline CSS and JavaScript that fetch the JSON API
(``/v1/jobs``, ``.../checkpoints``, ``.../events``, ``.../goodput``) and draw, per job, a timeline over time
and steps (steps at their save time, host-memory snapshots, outages, failures and restores), the bad steps
with their reasons, the elastic events with their recovery durations, and goodput with its window and
breakdown (what each part says: docs/operations.md, "The dashboard"). The page
itself holds no data, so ``/`` is open like ``/healthz``; when ckptd has a token, the page's API calls
need it: the page asks for it (kept in the browser's localStorage) or takes it from the URL fragment
``/#token=...`` (a fragment never reaches the server or its logs).

Data reaches the DOM only as text (``textContent``), never as HTML, and a Content-Security-Policy
allows nothing but the page's own inline code and same-origin API calls.
"""

from __future__ import annotations

from importlib.resources import files

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

from ckptd.api._openapi import route_doc
from trainer_client.core.protocol import ROUTE_DASHBOARD

CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
       "img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def dashboard_html() -> str:
    return files("ckptd.api").joinpath("static/dashboard.html").read_text(encoding="utf-8")


def router() -> APIRouter:
    page = dashboard_html()  # read once: a missing file fails at start, not at the first visit
    headers = {"Content-Security-Policy": CSP, "Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"}
    api = APIRouter(tags=["dashboard"])

    @api.get(ROUTE_DASHBOARD, response_class=HTMLResponse, **route_doc("GET", ROUTE_DASHBOARD))
    def dashboard() -> HTMLResponse:
        """The dashboard page (HTML). Open without a token; its API calls send the token when one is set."""
        return HTMLResponse(page, headers=headers)

    return api


__all__ = ["CSP", "dashboard_html", "router"]
