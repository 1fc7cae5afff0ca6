"""``/readyz`` tells anyone whether ckptd is ready, and only a caller with the token where the checkpoints live
and what failed reading them."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tests.support.server import app_over
from trainer_client.core import protocol as p

TOKEN = "s3cret-token"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / "root" / "llm").mkdir(parents=True)
    return tmp_path / "root"


def _readyz(client: TestClient, **headers: str) -> p.Health:
    resp = client.get("/readyz", headers=headers)
    assert resp.status_code == 200, resp.text
    return p.Health.model_validate(resp.json())


def test_readyz_shows_its_details_only_with_the_token(root: Path, tmp_path: Path) -> None:
    app = app_over(root, tmp_path, token=TOKEN)
    app.state.catalog.last_error = "StorageError: cannot list gs://secret-bucket/prefix: 403"
    with TestClient(app) as client:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
            anonymous = _readyz(client, **headers)
            assert anonymous.status == "ok" and anonymous.detail == {}, headers
        full = _readyz(client, Authorization=f"Bearer {TOKEN}")
        assert full.detail["root"] == str(root) and "secret-bucket" in str(full.detail["last_error"])
        assert isinstance(full.detail["last_refresh"], float)


def test_without_a_token_configured_readyz_shows_everything(root: Path, tmp_path: Path) -> None:
    with TestClient(app_over(root, tmp_path)) as client:  # the whole API is open then: so are the details
        assert _readyz(client).detail["root"] == str(root)
