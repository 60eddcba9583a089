"""Structured output and tool calls end to end: `pdserve up` (a JAX prefill worker samples the first token, a
torch decode worker the rest) and the unmodified openai SDK, on a random-weight model sampled at temperature 1.
Every answer parses and satisfies its constraint, streaming and not; `chat.completions.parse` returns the
object; tool_choice "required" and a named function answer calls whose arguments fit the function's schema."""

from __future__ import annotations

import json
import re
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

from pdserve.server.launcher import free_port
from tests.e2e.cluster import pdserve_up, wait_all_blocks_free

SEEDS = range(3)
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]


class Person(BaseModel):
    name: str = Field(max_length=6)
    age: int = Field(ge=0, le=120)
    role: Literal["admin", "user", "guest"]
    active: bool


PERSON = {**Person.model_json_schema(), "additionalProperties": False}
"""As strict mode has it (OpenAI refuses a strict schema without it; the SDK's `parse` adds it)."""


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    model_dir = tiny_model("llama")
    http_port = free_port()
    with pdserve_up(model_dir, tmp_path_factory.mktemp("up"), prefill_workers=1, decode_workers=1,
                    extra_args=["--http-port", str(http_port), "--enable-auto-tool-choice",
                                "--tool-call-parser", "hermes"]) as state:
        state["http"] = f"http://127.0.0.1:{http_port}"
        state["model"] = model_dir.name
        yield state


@pytest.fixture(autouse=True)
def no_leaked_blocks(cluster):
    yield
    pairs = wait_all_blocks_free(cluster["decode"])
    assert all(free == total for free, total in pairs), f"leaked KV blocks (free, total): {pairs}"


@pytest.fixture
def sdk(cluster):
    with openai.OpenAI(base_url=f"{cluster['http']}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client


def _chat(sdk, cluster, stream: bool, seed: int, **kw) -> tuple[str, str]:
    """(content, finish_reason) of one chat answer at temperature 1, streamed or not."""
    out = sdk.chat.completions.create(model=cluster["model"], messages=MESSAGES, temperature=1.0, seed=seed,
                                      max_tokens=400, stream=stream, **kw)
    if not stream:
        return out.choices[0].message.content, out.choices[0].finish_reason
    pieces, finish = [], None
    for chunk in out:
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    return "".join(pieces), finish


def _completion(sdk, cluster, stream: bool, seed: int, structured_outputs: dict) -> tuple[str, str]:
    out = sdk.completions.create(model=cluster["model"], prompt="The answer is", temperature=1.0, seed=seed,
                                 max_tokens=64, stream=stream, extra_body={"structured_outputs": structured_outputs})
    if not stream:
        return out.choices[0].text, out.choices[0].finish_reason
    chunks = list(out)
    return "".join(c.choices[0].text for c in chunks if c.choices), \
        next(c.choices[0].finish_reason for c in reversed(chunks) if c.choices and c.choices[0].finish_reason)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_json_schema_strict_answers_fit_the_schema(cluster, sdk, stream):
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for seed in SEEDS:
        text, finish = _chat(sdk, cluster, stream, seed, response_format=rf)
        assert finish == "stop", (finish, text)
        person = Person.model_validate_json(text)  # types, bounds, enum, no extra keys
        assert set(json.loads(text)) == {"name", "age", "role", "active"} and person.age <= 120


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_json_object_answers_are_json_objects(cluster, sdk, stream):
    """A random model may write one string for longer than any budget (json_object bounds whitespace, not
    strings): an answer cut by max_tokens is an object's beginning; every complete one is an object."""
    finished = 0
    for seed in range(6):
        text, finish = _chat(sdk, cluster, stream, seed, response_format={"type": "json_object"})
        assert finish in ("stop", "length") and text.startswith("{"), (finish, text)
        if finish == "stop":
            assert isinstance(json.loads(text), dict)
            finished += 1
    assert finished >= 3, f"only {finished} of 6 answers completed within max_tokens"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_choice_and_regex_through_completions(cluster, sdk, stream):
    for seed in SEEDS:
        text, finish = _completion(sdk, cluster, stream, seed, {"choice": ["positive", "negative", "neutral"]})
        assert (text, finish) in {("positive", "stop"), ("negative", "stop"), ("neutral", "stop")}, text
        text, finish = _completion(sdk, cluster, stream, seed, {"regex": r"[0-9]{3}-[a-z]{2,4}"})
        assert finish == "stop" and re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", text), text


def test_chat_with_structured_outputs_grammar(cluster, sdk):
    grammar = 'root ::= "yes" | "no" | "maybe " [0-9]'
    for seed in SEEDS:
        text, finish = _chat(sdk, cluster, False, seed, extra_body={"structured_outputs": {"grammar": grammar}})
        assert finish == "stop" and re.fullmatch("yes|no|maybe [0-9]", text), text


def test_parse_returns_the_pydantic_object(cluster, sdk):
    for seed in SEEDS:
        done = sdk.chat.completions.parse(model=cluster["model"], messages=MESSAGES, response_format=Person,
                                          temperature=1.0, seed=seed, max_tokens=400)
        parsed = done.choices[0].message.parsed
        assert isinstance(parsed, Person) and parsed.role in ("admin", "user", "guest")


def test_a_bad_schema_is_a_400_naming_the_field(cluster, sdk):
    with pytest.raises(openai.BadRequestError) as e:
        sdk.chat.completions.create(model=cluster["model"], messages=MESSAGES, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": "no"}}})
    assert e.value.body["param"] == "response_format.json_schema.schema"
    with pytest.raises(openai.BadRequestError) as e:
        sdk.completions.create(model=cluster["model"], prompt="x", extra_body={"structured_outputs": {"regex": "(a"}})
    assert e.value.body["param"] == "structured_outputs.regex" and "unclosed group" in e.value.body["message"]


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


def _check_call(call) -> None:
    args = json.loads(call.function.arguments)
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    if call.function.name == "get_weather":
        assert set(args) == {"city", "days"} and args["city"] in ("Paris", "Oslo", "Lima") and 1 <= args["days"] <= 7
    else:
        assert call.function.name == "get_time" and re.fullmatch("[A-Z]{3}", args["zone"]), args


def _tool_answer(sdk, cluster, stream: bool, seed: int, **kw):
    """(tool calls, finish_reason) of one chat answer; streamed deltas reassembled by index, as SDKs do."""
    out = sdk.chat.completions.create(model=cluster["model"], messages=MESSAGES, temperature=1.0, seed=seed,
                                      max_tokens=300, tools=TOOLS, stream=stream, **kw)
    if not stream:
        return out.choices[0].message.tool_calls, out.choices[0].finish_reason
    calls: dict[int, dict] = {}
    finish = None
    for chunk in out:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or ():
                c = calls.setdefault(d.index, {"id": "", "type": "function", "name": "", "arguments": ""})
                c["id"] += d.id or ""
                c["name"] += d.function.name or ""
                c["arguments"] += d.function.arguments or ""
    from openai.types.chat import ChatCompletionMessageToolCall
    return [ChatCompletionMessageToolCall(id=c["id"], type="function",
                                          function={"name": c["name"], "arguments": c["arguments"]})
            for _, c in sorted(calls.items())], finish


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_required_tool_calls_fit_their_functions(cluster, sdk, stream):
    for seed in SEEDS:
        calls, finish = _tool_answer(sdk, cluster, stream, seed, tool_choice="required")
        assert finish == "tool_calls" and calls
        for call in calls:
            _check_call(call)
    calls, _ = _tool_answer(sdk, cluster, stream, 9, tool_choice="required", parallel_tool_calls=False)
    assert len(calls) == 1


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_named_function_is_called_with_fitting_arguments(cluster, sdk, stream):
    for seed in SEEDS:
        calls, finish = _tool_answer(sdk, cluster, stream, seed,
                                     tool_choice={"type": "function", "function": {"name": "get_time"}})
        assert finish == "tool_calls" and [c.function.name for c in calls] == ["get_time"]
        _check_call(calls[0])


def test_auto_parses_hermes_calls_out_of_the_text(cluster, sdk):
    """A random model writes no call of its own: a regex holds it to one hermes call, which auto parses out."""
    hermes = r'<tool_call>\n\{"name": "get_time", "arguments": \{"zone": "[A-Z]{3}"\}\}\n</tool_call>'
    for stream in (False, True):
        calls, finish = _tool_answer(sdk, cluster, stream, 1, tool_choice="auto",
                                     extra_body={"structured_outputs": {"regex": hermes}})
        assert finish == "tool_calls" and [c.function.name for c in calls] == ["get_time"]
        _check_call(calls[0])
    text, finish = _chat(sdk, cluster, False, 2, tools=TOOLS, extra_body={"structured_outputs": {"regex": "[a-z]{4}"}})
    assert finish == "stop" and re.fullmatch("[a-z]{4}", text)


def test_tool_refusals_name_the_field(cluster, sdk):
    cases = [
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}],
              tool_choice="required"), "tools[0].function.parameters"),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "tool_choice"),
    ]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            sdk.chat.completions.create(model=cluster["model"], messages=MESSAGES, **kwargs)
        assert e.value.body["param"] == param, e.value.body
