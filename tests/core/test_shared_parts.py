"""``json_docs.loads_sharing``: a document whose per-array part is byte for byte an earlier document's is
parsed without it and given the earlier value, and reads exactly as a full parse would; any other document
is parsed in full. No jax, no files."""

from __future__ import annotations

import json
from typing import Any

from trainer_client.core.format import _json_docs as json_docs


def _arrays(n: int = 200, spec: str = "data") -> dict[str, Any]:
    return {f"params.layer{i:04d}": {"shape": [8, 16], "dtype": "float32", "partition_spec": [None, spec],
                                     "changed": False} for i in range(n)}


def _doc(step: int, arrays: dict[str, Any], key: str, **extra: Any) -> dict[str, Any]:
    return {"step": step, "meta": {"wall_time": 1.5 + step, key: arrays, "batch": None}, "after": [step], **extra}


RENDERINGS = {
    "compact (pydantic, orjson)": lambda d: json.dumps(d, separators=(",", ":")).encode(),
    "Python's json (Orbax)": lambda d: json.dumps(d).encode(),
    "indented (older manifests)": lambda d: json.dumps(d, indent=1).encode(),
}


def test_a_part_seen_before_is_shared_and_reads_as_a_full_parse() -> None:
    for i, render in enumerate(RENDERINGS.values()):
        key = f"arrays_{i}"  # a path of its own: the memos of other tests do not matter
        path = ("meta", key)
        first = json_docs.loads_sharing(render(_doc(1, _arrays(), key)), path)
        raw = render(_doc(2, _arrays(), key))
        second = json_docs.loads_sharing(raw, path)
        assert second == json.loads(raw)
        assert second["meta"][key] is first["meta"][key]  # not parsed again
        validated = json_docs.validated_arrays(second["meta"][key])
        assert validated["params.layer0003"].partition_spec == [None, "data"]


def test_a_changed_byte_or_another_place_is_never_shared() -> None:
    key, path = "arrays_changed", ("meta", "arrays_changed")
    render = RENDERINGS["compact (pydantic, orjson)"]
    json_docs.loads_sharing(render(_doc(1, _arrays(), key)), path)
    bad = _arrays()
    bad["params.layer0150"]["shape"] = "eight"
    raw = render(_doc(2, bad, key))
    assert json_docs.loads_sharing(raw, path)["meta"][key]["params.layer0150"]["shape"] == "eight"
    # the same bytes under another key, and the place itself holding something else
    other = _doc(3, {}, key, elsewhere=_arrays())
    raw = render(other)
    assert json_docs.loads_sharing(raw, path) == other
    # the part twice under the same key: the last one counts, as for any parse
    twice = render(_doc(4, _arrays(), key))[:-1] + b',"meta":{"' + key.encode() + b'":{"x":1}}}'
    assert json_docs.loads_sharing(twice, path) == json.loads(twice)
    assert json_docs.loads_sharing(twice, path)["meta"] == {key: {"x": 1}}


def test_numbers_read_as_written_around_a_shared_part() -> None:
    key, path = "arrays_numbers", ("meta", "arrays_numbers")
    render = RENDERINGS["Python's json (Orbax)"]
    json_docs.loads_sharing(render(_doc(1, _arrays(), key)), path)
    raw = render(_doc(2, _arrays(), key, big=2**70 + 1, neg=-(2**64)))
    parsed = json_docs.loads_sharing(raw, path)
    assert parsed["big"] == 2**70 + 1 and isinstance(parsed["big"], int) and parsed["neg"] == -(2**64)
    assert json_docs.loads(b'{"size": 18446744073709551617}')["size"] == 18446744073709551617


def test_a_shared_part_is_rendered_as_the_whole_document_would_be() -> None:
    key, path = "arrays_render", ("meta", "arrays_render")
    render = RENDERINGS["indented (older manifests)"]
    json_docs.loads_sharing(render(_doc(1, _arrays(), key)), path)
    doc = json_docs.loads_sharing(render(_doc(2, _arrays(), key, big=2**63 - 1)), path)
    assert json_docs.dumps_sharing(doc, path) == json_docs.dumps(doc)
    assert json_docs.dumps_sharing(doc, path) == json_docs.dumps(doc)  # the part's rendering kept: same bytes
    assert doc == json.loads(render(_doc(2, _arrays(), key, big=2**63 - 1)))  # the document is left as it was
