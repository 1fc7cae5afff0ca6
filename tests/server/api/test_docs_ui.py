"""``/docs`` is served whole by ckptd: Swagger UI's files come from the package (the
vendored swagger-ui-dist, checked against the digests its README records), the page names no other origin
and forbids loading from one, and a headless Chromium that can reach nothing but ckptd renders every
operation of the API from it.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from ckptd.api._app import create_app
from ckptd.api._docs_ui import ASSETS, ASSETS_URL, DOCS_URL
from tests.support.chromium import run_chromium
from tests.support.helpers import REPO, make_settings
from tests.support.server import ServerHandle, start_server
from trainer_client.core import protocol as p

VENDORED = REPO / "ckptd" / "api" / "static" / "swagger-ui"


@pytest.fixture
def client(tmp_path: Path) -> TestClient:
    (tmp_path / "root").mkdir()
    return TestClient(create_app(make_settings(tmp_path / "root", tmp_path / "state"), background=False))


def test_the_docs_page_loads_nothing_from_another_origin(client: TestClient) -> None:
    page = client.get(DOCS_URL)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert not re.search(r"""(?:src|href)\s*=\s*["'](?:https?:)?//""", page.text), "a remote script or style"
    assert "cdn" not in page.text.lower()
    csp = page.headers["content-security-policy"]
    assert "default-src 'self'" in csp and "script-src 'self' 'unsafe-inline'" in csp and "http" not in csp
    for name, media_type in ASSETS.items():
        assert f"{ASSETS_URL}/{name}" in page.text, name
        served = client.get(f"{ASSETS_URL}/{name}")
        assert served.status_code == 200 and served.headers["content-type"] == media_type, name
        assert served.content == (VENDORED / name).read_bytes(), name
    missing = client.get(f"{ASSETS_URL}/LICENSE")  # only the page's assets are served, nothing else of the package
    assert missing.status_code == 404 and missing.json()["code"] == p.ErrorCode.ROUTE_NOT_FOUND.value
    assert client.get("/redoc").status_code == 404  # FastAPI's ReDoc page would load from a CDN


def test_the_vendored_files_are_the_recorded_release_with_its_license() -> None:
    readme = (VENDORED / "README.md").read_text()
    recorded = dict(re.findall(r"^\| `([^`]+)` \| `([0-9a-f]{64})` \|$", readme, re.M))
    assert set(recorded) == set(ASSETS)
    for name, digest in recorded.items():
        assert hashlib.sha256((VENDORED / name).read_bytes()).hexdigest() == digest, name
    assert "Apache License" in (VENDORED / "LICENSE").read_text()
    assert re.search(r"swagger-ui-dist` \*\*5\.\d+\.\d+\*\*", readme)
    pyproject = (REPO / "pyproject.toml").read_text()
    assert '"static/swagger-ui/*"' in pyproject, "the package must install the files"


def test_swagger_ui_renders_the_api_without_any_other_host(
    live_server: ServerHandle, tmp_path: Path,
) -> None:
    """Every host name but ckptd's own address resolves to nothing, as on a machine offline."""
    dom = run_chromium(f"{live_server.url}{DOCS_URL}", tmp_path / "profile", "--dump-dom",
                       "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1")
    assert "swagger-ui" in dom
    for route in (p.ROUTE_JOBS, p.ROUTE_RESUME, p.ROUTE_ADVICE):
        assert f'data-path="{route}"' in dom, route  # Swagger UI drew the operation from /openapi.json


@pytest.fixture
def live_server(tmp_path: Path) -> Iterator[ServerHandle]:
    (tmp_path / "root").mkdir()
    handle = start_server(tmp_path / "root", tmp_path / "state")
    yield handle
    handle.stop()
