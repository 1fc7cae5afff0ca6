"""Generate docs/api.md, the HTTP API reference, from the app's own OpenAPI schema.

``python -m ckptd.api._gen_docs > docs/api.md``. The schema is what the running server serves at
``/openapi.json`` (routes and models from ``trainer_client.core.protocol``), so the reference cannot describe
an API the code does not have; ``tests/server/api/test_api_docs.py`` fails when the committed file differs from what
this prints now. Deterministic: no time, no paths, no environment in the output.
"""

from __future__ import annotations

import sys
import tempfile
from typing import Any

_METHODS = ("get", "post", "put", "patch", "delete")
_CONSTRAINTS = (("minimum", "≥ {}"), ("exclusiveMinimum", "> {}"), ("maximum", "≤ {}"), ("exclusiveMaximum", "< {}"),
                ("minLength", "length ≥ {}"), ("maxLength", "length ≤ {}"), ("minItems", "items ≥ {}"),
                ("maxItems", "items ≤ {}"), ("pattern", "pattern `{}`"))


def openapi_schema() -> dict[str, Any]:
    """The OpenAPI document of an app over an empty root (the schema does not depend on the root)."""
    from ckptd.api._app import create_app
    from ckptd.catalog._catalog import Catalog
    from ckptd.config import Settings
    from trainer_client.core import Storage

    with tempfile.TemporaryDirectory() as root:
        settings = Settings(root=root, state_dir=root, token=None, token_file=None)
        catalog = Catalog(Storage(root), ":memory:")
        try:
            return create_app(settings, catalog, background=False).openapi()
        finally:
            catalog.close()


def _ref_name(ref: str) -> str:
    return ref.rsplit("/", 1)[-1]


def type_of(schema: dict[str, Any]) -> str:
    """A short, readable type for a JSON schema: ``int``, ``list[str]``, ``ErrorBody | null``..."""
    if "$ref" in schema:
        name = _ref_name(schema["$ref"])
        return f"[`{name}`](#{name.lower()})"
    if "anyOf" in schema:
        return " \\| ".join(type_of(s) for s in schema["anyOf"])
    if "allOf" in schema and len(schema["allOf"]) == 1:
        return type_of(schema["allOf"][0])
    if "enum" in schema:
        return " \\| ".join(f"`{v!s}`" if not isinstance(v, str) else f'`"{v}"`' for v in schema["enum"])
    if "const" in schema:
        return f'`"{schema["const"]}"`' if isinstance(schema["const"], str) else f"`{schema['const']}`"
    kind = schema.get("type")
    if kind == "array":
        return f"list[{type_of(schema.get('items', {}))}]"
    if kind == "object":
        extra = schema.get("additionalProperties")
        return f"object[str, {type_of(extra)}]" if isinstance(extra, dict) and extra else "object"
    names = {"integer": "int", "number": "float", "string": "str", "boolean": "bool", "null": "null"}
    return names.get(str(kind), "any")


def constraints_of(schema: dict[str, Any]) -> str:
    parts = [fmt.format(schema[key]) for key, fmt in _CONSTRAINTS if key in schema]
    for sub in schema.get("anyOf", []):
        parts += [fmt.format(sub[key]) for key, fmt in _CONSTRAINTS if key in sub]
    return ", ".join(parts)


def _cell(text: object) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _default(schema: dict[str, Any]) -> str:
    if "default" not in schema:
        return ""
    value = schema["default"]
    return "`null`" if value is None else f"`{value!r}`" if not isinstance(value, str) else f'`"{value}"`'


def _route(method: str, path: str, op: dict[str, Any]) -> list[str]:
    out = [f"### `{method.upper()} {path}`", ""]
    summary, description = op.get("summary", ""), op.get("description", "")
    out += [description.strip() or summary, ""]
    params = op.get("parameters", [])
    if params:
        out += ["| parameter | in | type | required | default | constraints | description |",
                "|---|---|---|---|---|---|---|"]
        for prm in params:
            sch = prm.get("schema", {})
            required = "yes" if prm.get("required") else "no"
            description = _cell(prm.get("description", sch.get("description", "")))
            out.append(f"| `{prm['name']}` | {prm['in']} | {type_of(sch)} | {required} "
                       f"| {_default(sch)} | {constraints_of(sch)} | {description} |")
        out.append("")
    body = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
    if body:
        out += [f"Request body (JSON): {type_of(body)}", ""]
    out += ["| status | body | meaning |", "|---|---|---|"]
    for status, resp in sorted(op.get("responses", {}).items()):
        content = resp.get("content", {})
        kind = next(iter(content), "")
        schema = content.get(kind, {}).get("schema", {})
        shown = type_of(schema) if schema.get("$ref") or schema.get("type") not in (None, "string") else f"`{kind}`"
        out.append(f"| {status} | {shown if kind else ''} | {_cell(resp.get('description', ''))} |")
    return [*out, ""]


def _model(name: str, schema: dict[str, Any]) -> list[str]:
    out = [f"### `{name}`", ""]
    if schema.get("description"):
        out += [" ".join(schema["description"].split()), ""]
    if "enum" in schema:
        return [*out, "One of: " + ", ".join(f"`{v}`" for v in schema["enum"]), ""]
    props = schema.get("properties", {})
    required = set(schema.get("required", []))
    out += ["| field | type | required | default | constraints | description |", "|---|---|---|---|---|---|"]
    for field, sch in props.items():
        out.append(f"| `{field}` | {type_of(sch)} | {'yes' if field in required else 'no'} | {_default(sch)} "
                   f"| {constraints_of(sch)} | {_cell(sch.get('description', ''))} |")
    extra = schema.get("additionalProperties")
    if extra is False:
        out += ["", "Unknown fields are rejected."]
    return [*out, ""]


def render(schema: dict[str, Any]) -> str:
    info = schema.get("info", {})
    lines = [
        "# ckptd HTTP API reference",
        "",
        "<!-- Generated by `python -m ckptd.api._gen_docs > docs/api.md` from the app's OpenAPI schema. Do not edit:",
        "     tests/server/api/test_api_docs.py fails when this file differs from what the generator prints. -->",
        "",
        f"{info.get('title', 'ckptd')} {info.get('version', '')} — OpenAPI {schema.get('openapi', '')}. "
        f"{info.get('description', '')}",
        "",
        "This page is generated from the schema the server serves at `GET /openapi.json`. What the answers "
        "mean, worked examples, the error codes and the command line are in [protocol.md](protocol.md); "
        "the concepts in [concepts.md](concepts.md).",
        "",
        "## Routes",
        "",
        "| method | path | summary |",
        "|---|---|---|",
    ]
    routes = [(m, path, op) for path, ops in schema.get("paths", {}).items() for m in _METHODS if m in ops
              for op in (ops[m],)]
    for m, path, op in routes:
        lines.append(f"| {m.upper()} | `{path}` | {_cell(op.get('summary', ''))} |")
    lines.append("")
    for m, path, op in routes:
        lines += _route(m, path, op)
    lines += ["## Models", ""]
    for name, model in sorted(schema.get("components", {}).get("schemas", {}).items()):
        lines += _model(name, model)
    return "\n".join(lines).rstrip() + "\n"


def main() -> int:
    sys.stdout.write(render(openapi_schema()))
    return 0


__all__ = ["constraints_of", "main", "openapi_schema", "render", "type_of"]


if __name__ == "__main__":
    sys.exit(main())
