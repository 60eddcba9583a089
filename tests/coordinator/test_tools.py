"""Tools: the plan a request's tools and tool_choice make (the grammar of `required` and named calls, each
refusal naming the field), the parsers of `auto`, and the template's `tools` variable."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer as HfTokenizer

from pdserve.v1 import generation_pb2
from pdserve.server.coordinator.chat_template import ChatTemplate
from pdserve.server.coordinator.config import CoordinatorConfig
from pdserve.server.coordinator.openai.errors import ApiError
from pdserve.server.coordinator.openai.tool_parsers import hermes, llama3_json, mistral
from pdserve.server.coordinator.openai.tools import check_tools_grammar, required_schema, tool_plan
from tests.coordinator.test_structured_outputs import Checks

F = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": F}},
         {"type": "function", "function": {"name": "g"}}]


def test_required_is_an_array_of_calls_each_fitting_its_function():
    plan = tool_plan(TOOLS, "required", None, False, None)
    assert plan.mode == "required"
    want = {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "properties": {"name": {"const": "f"}, "parameters": F}, "required": ["name", "parameters"],
         "additionalProperties": False},
        {"type": "object", "properties": {"name": {"const": "g"}, "parameters": {"type": "object"}},
         "required": ["name", "parameters"], "additionalProperties": False}]}}
    assert json.loads(plan.structured().json_schema) == want
    assert required_schema(plan.schemas, parallel=False)["maxItems"] == 1
    assert plan.calls('[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}]') == \
        (None, [("f", '{"a": 1}'), ("g", "{}")])


def test_a_named_function_is_held_to_its_parameters():
    plan = tool_plan(TOOLS, {"type": "function", "function": {"name": "f"}}, None, False, None)
    assert plan.structured() == generation_pb2.StructuredOutput(json_schema=json.dumps(F))
    assert plan.calls('{"a": 2}') == (None, [("f", '{"a": 2}')])


def test_none_and_auto():
    assert tool_plan(TOOLS, "none", None, False, None).structured() is None
    assert tool_plan(None, None, None, False, None) is None
    auto = tool_plan(TOOLS, None, None, True, "hermes")
    assert auto.mode == "auto" and auto.structured() is None
    assert auto.calls('ok <tool_call>{"name": "f", "arguments": {"a": 3}}</tool_call>') == ("ok ", [("f", '{"a": 3}')])


@pytest.mark.parametrize("tools, choice, auto, param, words", [
    (TOOLS, {"type": "function", "function": {"name": "h"}}, False, "tool_choice", "'h' is not among the tools (f, g)"),
    (TOOLS, "sometimes", False, "tool_choice", "one of"),
    (TOOLS, "auto", False, "tool_choice", "--enable-auto-tool-choice"),
    (TOOLS, None, False, "tool_choice", "--enable-auto-tool-choice"),
    (None, "required", False, "tool_choice", "needs tools"),
    ([{"type": "function"}], "required", False, "tools[0]", "a tool is"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}], "required", False,
     "tools[0].function.parameters", "Invalid type: foo"),
])
async def test_refusals_name_the_field(tools, choice, auto, param, words):
    with pytest.raises(ApiError) as e:
        await check_tools_grammar(tool_plan(tools, choice, None, auto, "hermes" if auto else None), Checks())
    assert e.value.status == 400 and e.value.param == param and words in e.value.message, e.value.message


def test_parsers_take_their_formats_and_leave_other_text_as_content():
    assert hermes('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>{"name": "g", '
                  '"arguments": {}}</tool_call>') == (None, [("f", '{"a": 1}'), ("g", "{}")])
    assert hermes("no call") == ("no call", [])
    assert hermes("<tool_call>{broken") == ("<tool_call>{broken", [])
    assert llama3_json('<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}') == \
        (None, [("f", '{"a": 1}'), ("g", "{}")])
    assert llama3_json("words") == ("words", [])
    assert mistral('Sure[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}]') == ("Sure", [("f", '{"a": 1}')])
    assert mistral("[TOOL_CALLS]nope") == ("[TOOL_CALLS]nope", [])


def test_the_template_renders_the_tools(tiny_model):
    path = tiny_model("llama")
    template = ChatTemplate("{% for t in tools %}{{ t.function.name }};{% endfor %}{{ messages[0].content }}",
                            HfTokenizer.from_file(str(path / "tokenizer.json")), {})
    text, _ = template.encode([{"role": "user", "content": "hi"}], tools=TOOLS)
    assert text == "f;g;hi"


def test_auto_tool_choice_needs_a_parser(tmp_path):
    with pytest.raises(ValueError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        CoordinatorConfig(model_dir=tmp_path, enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="--tool-call-parser must be one of hermes, llama3_json, mistral"):
        CoordinatorConfig(model_dir=tmp_path, tool_call_parser="pythonic")


def test_a_conversation_with_calls_renders_their_arguments_as_objects(tiny_model):
    path = tiny_model("llama")
    template = ChatTemplate(
        "{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% for c in m.tool_calls or [] %}[{{ c.function.name }} {{ c.function.arguments.a }}]{% endfor %};"
        "{% endfor %}", HfTokenizer.from_file(str(path / "tokenizer.json")), {})
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 7}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    assert template.render(messages, add_generation_prompt=False) == "user:hi;assistant:[f 7];tool:42;"


def test_content_streams_up_to_where_a_call_can_begin():
    from pdserve.server.coordinator.openai.tool_parsers import content_so_far

    assert content_so_far("hermes", "Let me check.") == 13
    assert content_so_far("hermes", "Let me check.<tool") == 13  # "<tool" may begin "<tool_call>"
    assert content_so_far("hermes", "Let me <b>") == 10
    assert content_so_far("hermes", 'ok<tool_call>{"name"') == 2
    assert content_so_far("mistral", "Sure[TOOL") == 4
    assert content_so_far("llama3_json", ' {"name"') == 0  # a bare JSON call
    assert content_so_far("llama3_json", "Hello") == 5
    plan = tool_plan(TOOLS, "required", None, False, None)
    assert plan.streamable("[{") == 0


async def test_auto_streams_the_content_then_the_calls_and_answers_them_whole(tiny_model):
    import openai

    from tests.coordinator.fakes import start_fake_pools

    path = tiny_model("llama")
    pools = await start_fake_pools(path, http_port=0, enable_auto_tool_choice=True, tool_call_parser="hermes")
    try:
        tok = HfTokenizer.from_file(str(path / "tokenizer.json"))
        text = 'Checking. <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
        ids = tok.encode(text, add_special_tokens=False).ids
        base = f"http://127.0.0.1:{pools.coordinator.http.port}/v1"
        async with openai.AsyncOpenAI(base_url=base, api_key="x", max_retries=0) as sdk:
            for stream in (False, True):
                pools.prefill.first_token_id = ids[0]
                pools.decode.events = [[i] for i in ids[1:]]
                pools.decode.finish = generation_pb2.FINISH_REASON_STOP
                out = await sdk.chat.completions.create(
                    model=path.name, messages=[{"role": "user", "content": "x"}], tools=TOOLS, stream=stream)
                if not stream:
                    message = out.choices[0].message
                    assert out.choices[0].finish_reason == "tool_calls" and message.content == "Checking. "
                    named = [(c.function.name, c.function.arguments) for c in message.tool_calls]
                    assert named == [("f", '{"a": 1}')]
                    continue
                content, calls, finish = [], [], None
                async for chunk in out:
                    for choice in chunk.choices:
                        if choice.delta.content:
                            assert not calls  # content comes first
                            content.append(choice.delta.content)
                        calls += choice.delta.tool_calls or []
                        finish = choice.finish_reason or finish
                assert "".join(content) == "Checking. " and len(content) > 1  # streamed, not in one piece
                assert [(c.index, c.function.name, c.function.arguments) for c in calls] == [(0, "f", '{"a": 1}')]
                assert calls[0].id.startswith("chatcmpl-tool-") and finish == "tool_calls"
    finally:
        await pools.stop()
