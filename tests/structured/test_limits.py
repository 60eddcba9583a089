"""The spec limits: refused in plain Python, before any native work, naming the field, the limit and its flag,
and never by a RecursionError however deep the input nests."""

from __future__ import annotations

import json
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pdserve.server.coordinator.config import CoordinatorConfig
from pdserve.server.structured.checker import SpecChecker
from pdserve.server.structured.limits import (
    LimitError,
    SpecLimits,
    check_spec,
    check_tools,
    count_defs,
    grammar_rules,
    json_depth,
    schema_text,
    value_depth,
)
from pdserve.server.structured.output_spec import SpecError
from pdserve.v1 import generation_pb2 as gen_pb

SO = gen_pb.StructuredOutput


def deep_text(levels: int) -> str:
    return '{"a":' * levels + "1" + "}" * levels


def deep_value(levels: int) -> dict:
    value: dict = {}
    for _ in range(levels - 1):
        value = {"a": value}
    return value


def chained_defs(n: int) -> dict:
    """n $defs, each an object whose one property is the next (llguidance's stack overflows near 1,000)."""
    defs = {f"node{i}": {"type": "object", "properties": {"value": {"type": "integer"},
                                                          "next": {"$ref": f"#/$defs/node{i + 1}"}},
                         "required": ["value", "next"]} for i in range(n)}
    defs[f"node{n}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/node0"}


def chained_rules(n: int) -> str:
    """A Lark grammar of n chained rules (llguidance's stack overflows near 3,000)."""
    return "\n".join(["start: r0", *(f"r{i}: r{i + 1}" for i in range(n)), f'r{n}: "x"'])


def test_depth_is_counted_over_the_text_skipping_strings():
    assert json_depth('{"a": [1, {"b": "[[[{{{"}], "c": "\\"]"}') == 3
    assert json_depth("1") == 0 and json_depth("[]") == 1
    t0 = time.perf_counter()
    assert json_depth(deep_text(10_000)) == 10_000
    assert time.perf_counter() - t0 < 1.0
    assert value_depth(deep_value(10_000)) == 10_000  # no recursion: no RecursionError


def test_a_10000_deep_schema_is_refused_naming_the_field_and_flag():
    for spec in (SO(json_schema=deep_text(10_000)), SO(structural_tag=deep_text(10_000))):
        with pytest.raises(LimitError, match=r"^response_format: nests 10000 levels deep; the limit is 128 "
                                             r"\(--max-schema-depth\)"):
            check_spec(spec, "response_format", SpecLimits())
    with pytest.raises(LimitError, match=r"^tools\[0\]\.function\.parameters: nests 10000 levels"):
        schema_text(deep_value(10_000), "tools[0].function.parameters", SpecLimits())
    check_spec(SO(json_schema=deep_text(128)), "x", SpecLimits())  # at the limit: passes


def test_defs_rules_and_bytes():
    schema = {"$defs": {f"d{i}": {} for i in range(10_000)}}
    assert count_defs({"definitions": {"a": {"$defs": {"b": {}, "c": {}}}}}) == 3
    with pytest.raises(LimitError, match=r"^structured\.json_schema: 10000 \$defs/definitions; the limit is 256 "
                                         r"\(--max-schema-defs\)"):
        check_spec(SO(json_schema=json.dumps(schema)), "structured.json_schema", SpecLimits())
    assert grammar_rules(chained_rules(3000)) == 3002
    assert grammar_rules('root ::= a\na ::= "x" | b\n?b.2: "y"') == 3
    with pytest.raises(LimitError, match=r"^structured\.grammar: 3002 rules; the limit is 1024 \(--max-grammar-rules\)"):
        check_spec(SO(grammar=chained_rules(3000)), "structured.grammar", SpecLimits())
    with pytest.raises(LimitError, match=r"^structured\.regex: 262145 bytes; the limit is 262144 bytes "
                                         r"\(--max-spec-bytes\)"):
        check_spec(SO(regex="a" * (256 * 1024 + 1)), "structured.regex", SpecLimits())
    check_spec(SO(grammar=chained_rules(3000)), "g", SpecLimits(max_grammar_rules=4000))


def test_tools_count_and_bytes():
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    check_tools([tool] * 128, SpecLimits())
    with pytest.raises(LimitError, match=r"^tools: 129 tools; the limit is 128 \(--max-tools\)"):
        check_tools([tool] * 129, SpecLimits())
    big = {"type": "function", "function": {"name": "f", "parameters": {"description": "x" * 100_000}}}
    with pytest.raises(LimitError, match=r"^tools: their parameters schemas exceed 262144 bytes together "
                                         r"\(--max-tool-schema-bytes\)"):
        check_tools([big] * 3, SpecLimits())


class NoPool:
    """A pool that must not be reached: the limits refuse first."""

    def submit(self, *args, **kwargs):
        raise AssertionError("native work was started for a spec over the limits")

    async def run(self, *args, **kwargs):
        raise AssertionError("native work was started for a spec over the limits")


async def test_the_checker_refuses_over_the_limits_before_any_native_work():
    checker = SpecChecker(SpecLimits(), NoPool(), field="structured")
    for spec, words in [(SO(json_schema=deep_text(10_000)), "structured.json_schema: nests 10000"),
                        (SO(json_schema=json.dumps({"$defs": {f"d{i}": {} for i in range(10_000)}})),
                         "structured.json_schema: 10000 $defs"),
                        (SO(json_schema=json.dumps(chained_defs(700))), "structured.json_schema: 701 $defs"),
                        (SO(grammar=chained_rules(3000)), "structured.grammar: 3002 rules")]:
        with pytest.raises(SpecError) as e:
            await checker.check(spec)
        assert str(e.value).startswith(words), str(e.value)
        with pytest.raises(SpecError):
            checker.check_sync(spec)
        assert not checker.passed(spec)


def test_the_flags_are_checked_and_reach_the_limits(tmp_path):
    config = CoordinatorConfig(tmp_path, max_schema_defs=2000, max_tools=4)
    assert SpecLimits.of(config) == SpecLimits(max_schema_defs=2000, max_tools=4)
    with pytest.raises(ValueError, match="--max-schema-depth must be an integer >= 1, got 0"):
        CoordinatorConfig(tmp_path, max_schema_depth=0)
    with pytest.raises(ValueError, match="--grammar-processes must be >= 1, got 0"):
        CoordinatorConfig(tmp_path, grammar_processes=0)


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(alphabet='{}[]"\\:,ab\u00e9\U0001f600'),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(alphabet='{}[]"\\ab'), inner,
                                                                                  max_size=4), max_leaves=30)


@settings(max_examples=300, deadline=None)
@given(JSON)
def test_the_text_depth_is_the_values_depth(value):
    """json_depth (over the text, strings skipped) and value_depth (over the parsed value) agree on any JSON,
    whatever brackets, quotes and escapes its strings hold."""
    assert json_depth(json.dumps(value)) == value_depth(value)
    assert json_depth(json.dumps(value, ensure_ascii=False)) == value_depth(value)
