"""response_format and structured_outputs: mapped to the StructuredOutput both tiers enforce, and every bad
spec refused with a 400 (or INVALID_ARGUMENT) naming the field, before any worker is asked."""

from __future__ import annotations

import json

import pytest

from pdserve.v1 import generation_pb2
from pdserve.server.coordinator.openai.errors import ApiError
from pdserve.server.coordinator.openai.structured import check_structured, structured_output, structured_where
from pdserve.server.coordinator.validate import InvalidRequest, Limits, check_spec, validate_sampling
from pdserve.server.structured.checker import SpecChecker
from tests.coordinator.test_openai import MODEL, client, cluster, model_dir  # noqa: F401 (fixtures)

SO = generation_pb2.StructuredOutput
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


class Checks:
    """What the OpenAI front awaits of GenerationService: its spec check, in a grammar child process."""

    def __init__(self):
        self.checker = SpecChecker(field="structured")

    async def check_spec(self, spec, where=None):
        await check_spec(spec, self.checker, where)


@pytest.mark.parametrize("response_format, structured_outputs, want", [
    ({"type": "text"}, None, None),
    ({"type": "json_object"}, None, SO(json_object=True)),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}, None,
     SO(json_schema=json.dumps(SCHEMA))),
    (None, {"json": SCHEMA}, SO(json_schema=json.dumps(SCHEMA))),
    (None, {"json": json.dumps(SCHEMA)}, SO(json_schema=json.dumps(SCHEMA))),
    (None, {"json_object": True}, SO(json_object=True)),
    (None, {"regex": "[a-z]+"}, SO(regex="[a-z]+")),
    (None, {"choice": ["yes", "no"]}, SO(choice=generation_pb2.Choices(choices=["yes", "no"]))),
    (None, {"grammar": 'root ::= "a"', "disable_fallback": True}, SO(grammar='root ::= "a"')),
    (None, None, None),
])
def test_each_form_maps_to_its_structured_output(response_format, structured_outputs, want):
    assert structured_output(response_format, structured_outputs) == want


@pytest.mark.parametrize("response_format, structured_outputs, param, words", [
    ({"type": "xml"}, None, "response_format.type", "one of text, json_object"),
    ({"type": "json_schema"}, None, "response_format.json_schema", 'needs {"name", "schema"}'),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}, None,
     "response_format.json_schema.schema", "Invalid type: foo"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, None,
     "response_format.json_schema.schema", "a JSON schema is an object"),
    (None, {"regex": "(ab"}, "structured_outputs.regex", "unclosed group"),
    (None, {"json": {"type": "string", "format": "zzz"}}, "structured_outputs.json", "Unknown format: zzz"),
    (None, {"choice": []}, "structured_outputs.choice", "1 to 1024 non-empty strings"),
    (None, {}, "structured_outputs", "set exactly one of"),
    (None, {"choice": [1, 2]}, "structured_outputs.choice", "a list of strings"),
    (None, {"regex": "a", "choice": ["a"]}, "structured_outputs", "got regex, choice"),
    (None, {"guided_json": {}}, "structured_outputs.guided_json", "unknown"),
    (None, {"regex": "a", "whitespace_pattern": " "}, "structured_outputs.whitespace_pattern", "not supported"),
    ({"type": "json_object"}, {"regex": "a"}, "structured_outputs", "not both"),
])
async def test_bad_specs_are_refused_naming_the_field(response_format, structured_outputs, param, words):
    with pytest.raises(ApiError) as e:
        spec = structured_output(response_format, structured_outputs)
        await check_structured(Checks(), spec, structured_where(response_format, structured_outputs))
    assert e.value.status == 400 and e.value.param == param and words in e.value.message, e.value.message


async def test_the_native_api_refuses_a_bad_spec_naming_the_field():
    limits = Limits(max_model_len=64, vocab_size=512)
    checker = SpecChecker(field="structured")
    sampling = validate_sampling(generation_pb2.SamplingParams(structured=SO(regex="(ab")), limits)
    with pytest.raises(InvalidRequest, match=r"^structured\.regex: .*unclosed group"):
        await check_spec(sampling.structured, checker)
    ok = validate_sampling(generation_pb2.SamplingParams(structured=SO(choice=generation_pb2.Choices(choices=["a"]))),
                           limits)
    assert ok.structured.choice.choices == ["a"]
    await check_spec(ok.structured, checker)


async def test_a_spec_reaches_both_workers_and_a_bad_one_none(cluster, client):
    cluster.script([5, 6])
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2,
                                                   "structured_outputs": {"regex": "[ab]+"}})
    assert r.status_code == 200, r.text
    assert cluster.decode.requests[-1].sampling.structured == SO(regex="[ab]+")
    assert cluster.prefill.requests[-1].sampling.structured == SO(regex="[ab]+")
    sent = len(cluster.decode.requests)
    r = await client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "response_format.json_schema.schema"
    assert len(cluster.decode.requests) == sent
