"""The server's bodies as pydantic models: what the validator accepts is what the generated
OpenAPI document describes, refusals name the place at fault, and the image judges' routes are
validated and documented from their own item model.

The document is checked with ``jsonschema`` (Draft 2020-12, the dialect of OpenAPI 3.1), an
implementation independent of pydantic, so the comparison is not the library against itself.
"""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest

pytest.importorskip("starlette")
jsonschema = pytest.importorskip("jsonschema")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from pydantic import BaseModel, ValidationError  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from fastjudge.engine_options import EngineOptions  # noqa: E402
from fastjudge.io.validation import describe, input_path, problems  # noqa: E402
from fastjudge.judges.items import ItemError, LaveItem, parse_lave_item  # noqa: E402
from fastjudge.serve import create_app  # noqa: E402


def validator(document: dict, name: str):
    """A Draft 2020-12 validator of the document's schema ``name``, resolving its ``$ref``s."""
    return jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{name}", **document})


@pytest.fixture(scope="module")
def lave_document(lave_judge) -> dict:
    with TestClient(create_app(lave_judge)) as c:
        return c.get("/openapi.json").json()


# -- places in the input -----------------------------------------------------------------------
class _Pair(BaseModel):
    answer: str


def test_input_path_keeps_only_the_steps_into_the_input():
    value = {"items": [{"references": ["a", {"answer": 3}]}]}
    # a union member's tag ("object") is not part of the input; a missing key at the end is
    assert input_path(("items", 0, "references", 1, "object", "answer"), value) == \
        "items[0].references[1].answer"
    assert input_path(("items", 0, "question"), value, "body") == "body.items[0].question"
    assert input_path((), value) == ""
    assert input_path(("items", 5), value) == "items"  # no such element: the list is the place


def test_a_union_refused_by_every_member_is_one_problem():
    with pytest.raises(ValidationError) as refused:
        _Pair.model_validate({"answer": [1]})
    assert problems(refused.value, {"answer": [1]}) == [("answer", "expected a string")]
    item = {"question": 1, "prediction": 2, "references": [], "caption": 3, "id": [1]}
    with pytest.raises(ValidationError) as refused:
        LaveItem.model_validate(item)
    message = describe(refused.value, item, "items[4]")
    assert message == ("items[4].question: expected a string; items[4].prediction: expected a "
                       "string; items[4].caption: expected a string (and 1 more)")


# -- the document describes the validator ------------------------------------------------------
_text = st.text(max_size=4)
_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) |
                     _text, lambda inner: st.lists(inner, max_size=2) |
                     st.dictionaries(_text, inner, max_size=2), max_leaves=4)
_field = _json | _text
_items = st.one_of(
    _json,
    st.fixed_dictionaries({}, optional={
        "question": _field, "prediction": _field, "caption": _field | st.none(),
        "id": _json, "extra": _json,
        "references": st.lists(_text | st.fixed_dictionaries({"answer": _field}) | _json,
                               max_size=3) | _json}))


@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(item=_items)
def test_the_documented_item_schema_accepts_exactly_what_the_server_accepts(lave_document, item):
    """Hypothesis-made items, valid and not: the served document's ``LaveItem`` schema and the
    server's parser (``parse_lave_item``) agree on each."""
    documented = validator(lave_document, "LaveItem").is_valid(item)
    try:
        parse_lave_item(item, "items[0]")
        accepted = True
    except ItemError:
        accepted = False
    assert documented == accepted, item


def test_the_document_is_generated_from_the_models(lave_document):
    """The item and request schemas are the models' own; every status a route answers is
    documented with its body."""
    schemas = lave_document["components"]["schemas"]
    assert schemas["ScoreRequest"]["properties"]["items"]["items"] == {
        "$ref": "#/components/schemas/LaveItem"}
    assert schemas["LaveItem"]["required"] == ["question", "references", "prediction"]
    score = lave_document["paths"]["/v1/score"]["post"]["responses"]
    assert set(score) == {"200", "400", "408", "413", "422", "429", "500", "503", "504"}
    chat = lave_document["paths"]["/v1/chat/completions"]["post"]
    assert chat["responses"]["400"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/OpenAIError"}


# -- an image judge's routes -------------------------------------------------------------------
def _png(size=(40, 32)) -> str:
    from PIL import Image

    pixels = np.random.default_rng(0).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode()


def test_an_image_judge_is_validated_and_documented_by_its_item_model(vl_dir):
    from fastjudge.judges.holistic import HolisticJudge

    judge = HolisticJudge(vl_dir, engine=EngineOptions(device="cpu", dtype="float32"))
    with TestClient(create_app(judge, "holistic")) as c:
        document = c.get("/openapi.json").json()
        item_schema = validator(document, "ImageTextItem")
        items = [{"image_b64": _png(), "text": "a photo", "id": "a"},
                 {"image_b64": _png(), "caption": "noise", "boxes": [[0, 0, 8, 8]], "id": 2}]
        assert all(item_schema.is_valid(item) for item in items)
        r = c.post("/v1/score", json={"items": items})
        assert r.status_code == 200
        validator(document, "ScoreResponse").validate(r.json())
        assert [x["id"] for x in r.json()["results"]] == ["a", 2]
        assert all(0 <= x["score"] <= 1 and x["decision"] in ("yes", "no")
                   for x in r.json()["results"])
        for bad, message in [
            ({"image": "/etc/passwd", "text": "x"}, "items[0]: the server does not read image "
                                                    "paths"),
            ({"image_b64": "not base64!", "text": "x"}, "items[0].image_b64: not valid base64"),
            ({"image_b64": _png()}, "items[0]: text (or caption) is required"),
            ({"image_b64": _png(), "text": "x", "boxes": [[0, 0, 8]]},
             "items[0].boxes[0]: List should have at least 4 items"),
        ]:
            r = c.post("/v1/score", json={"items": [bad]})
            assert r.status_code == 422 and r.json()["error"].startswith(message), r.json()
            # the document refuses each too, but base64 itself: JSON Schema 2020-12 treats
            # contentEncoding as an annotation, not an assertion
            assert item_schema.is_valid(bad) == (bad.get("image_b64") == "not base64!")
