"""``GET /docs``: Swagger UI over the app's own ``/openapi.json``, every file of it served by ckptd.

FastAPI's default page loads Swagger UI's script and style from a CDN: blank on a machine without the
internet, and a third-party script (without integrity pinning) running on the origin of the dashboard,
which keeps the API's bearer token. Here the files come from the package (``static/swagger-ui/``: the npm
``swagger-ui-dist``, vendored with its license; its README says which version and the files' digests),
and the page's Content-Security-Policy lets it load nothing from anywhere else. No ReDoc page (``/redoc``
would load from a CDN too).
"""

from __future__ import annotations

from functools import cache
from importlib.resources import files

from fastapi import FastAPI, Response
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse

from ckptd.api._errors import error_response
from trainer_client.core import protocol as p

DOCS_URL = "/docs"
ASSETS_URL = "/docs/assets"
ASSETS = {  # served name -> media type (nothing else under ASSETS_URL)
    "swagger-ui-bundle.js": "text/javascript; charset=utf-8",
    "swagger-ui.css": "text/css; charset=utf-8",
    "favicon-32x32.png": "image/png",
}
# Same origin only: the page's own inline start-up script and Swagger UI's inline styles, nothing remote.
CONTENT_SECURITY_POLICY = ("default-src 'self'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; "
                           "img-src 'self' data:; connect-src 'self'; object-src 'none'; frame-ancestors 'none'; "
                           "base-uri 'none'")


@cache
def asset(name: str) -> bytes:
    """A vendored Swagger UI file, read once."""
    return files("ckptd.api").joinpath(f"static/swagger-ui/{name}").read_bytes()


def install_docs(app: FastAPI) -> None:
    """Add ``/docs`` and its assets to ``app`` (built with ``docs_url=None, redoc_url=None``)."""

    @app.get(DOCS_URL, include_in_schema=False)
    async def docs() -> HTMLResponse:
        page = get_swagger_ui_html(
            openapi_url=app.openapi_url or "/openapi.json", title=f"{app.title} API",
            swagger_js_url=f"{ASSETS_URL}/swagger-ui-bundle.js", swagger_css_url=f"{ASSETS_URL}/swagger-ui.css",
            swagger_favicon_url=f"{ASSETS_URL}/favicon-32x32.png",
        )
        page.headers["Content-Security-Policy"] = CONTENT_SECURITY_POLICY
        return page

    @app.get(ASSETS_URL + "/{name}", include_in_schema=False)
    async def docs_asset(name: str) -> Response:
        media_type = ASSETS.get(name)
        if media_type is None:
            return error_response(p.ErrorCode.ROUTE_NOT_FOUND, f"no such file: {name}")
        return Response(asset(name), media_type=media_type,
                        headers={"Cache-Control": "public, max-age=86400", "X-Content-Type-Options": "nosniff"})


__all__ = ["ASSETS", "ASSETS_URL", "CONTENT_SECURITY_POLICY", "DOCS_URL", "install_docs"]
