"""The docs cannot drift from the code: docs/api.md is what ``python -m ckptd.api._gen_docs`` prints now, and
the hand-written pages name every route, metric and command the code has."""

from __future__ import annotations

import argparse
import re

from ckptd._metrics import Metrics
from ckptd.api._gen_docs import openapi_schema, render, type_of
from ckptd.cli._main import build_parser
from tests.support.helpers import REPO
from trainer_client.core import protocol as p

DOCS = REPO / "docs"


def test_the_committed_api_reference_is_what_the_generator_prints_now() -> None:
    generated = render(openapi_schema())
    committed = (DOCS / "api.md").read_text(encoding="utf-8")
    assert committed == generated, "docs/api.md is stale: run `python -m ckptd.api._gen_docs > docs/api.md`"


def test_the_reference_covers_every_route_and_model() -> None:
    schema = openapi_schema()
    text = render(schema)
    routes = [v for k, v in vars(p).items() if k.startswith("ROUTE_")]
    assert set(schema["paths"]) == set(routes)
    for route in routes:
        assert f"`{route}`" in text, route
    for model in ("ElasticEvent", "EventBatch", "EventList", "Goodput", "GoodputCauses", "ResumePlan", "ErrorBody"):
        assert f"### `{model}`" in text, model
    assert type_of({"anyOf": [{"type": "integer"}, {"type": "null"}]}) == "int \\| null"
    assert type_of({"type": "array", "items": {"$ref": "#/components/schemas/X"}}) == "list[[`X`](#x)]"


def _metric_names() -> set[str]:
    names = set()
    for metric in Metrics().registry.collect():
        suffix = "_total" if metric.type == "counter" else ""
        names.add(metric.name + suffix)
    return names


def test_protocol_and_operations_pages_name_every_route_metric_and_command() -> None:
    protocol = (DOCS / "protocol.md").read_text(encoding="utf-8")
    operations = (DOCS / "operations.md").read_text(encoding="utf-8")
    for method, route in (("POST", p.ROUTE_EVENTS), ("GET", p.ROUTE_EVENTS), ("GET", p.ROUTE_GOODPUT),
                          ("GET", p.ROUTE_DASHBOARD)):
        assert f"### `{method} {route}`" in protocol, (method, route)
    for name in _metric_names():
        assert f"`{name}`" in protocol, name
        assert f"`{name}`" in operations, name
    assert re.search(r"^## Metrics and dashboard$", operations, re.M)
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    commands = set(sub.choices)
    assert {"events", "goodput", "serve", "ls"} <= commands
    for command in commands:
        assert f"ckptd {command}" in protocol, command
    for kind in p.EVENT_KINDS:
        assert f"`{kind}`" in protocol, kind


def test_the_docs_are_linked_from_the_readme() -> None:
    readme = (DOCS.parent / "README.md").read_text(encoding="utf-8")
    for page in ("getting-started.md", "concepts.md", "api.md", "operations.md", "protocol.md"):
        assert f"(docs/{page})" in readme, page
        assert (DOCS / page).is_file(), page
