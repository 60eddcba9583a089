"""The sizes a structured-output spec may have, checked in plain Python before any native work touches it.

llguidance recurses on a grammar's rule chain: a JSON schema of ~1,000 chained `$defs` or a Lark grammar of
~3,000 chained rules overflows its stack and kills the process (SIGSEGV), and a deep schema makes Python's own
`json` raise RecursionError. So every tier first checks here, without recursion and without llguidance: the
spec's bytes, the JSON nesting depth of a schema (counted over the text, never by recursing), the number of
`$defs`/`definitions`, a grammar's rule count, and for OpenAI tools their number and total schema bytes. What
passes still runs its native work in a child process (pool.py); these limits keep the common attacks cheap.
Each refusal names the field, the limit and the flag that raises it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdserve.v1 import generation_pb2 as gen_pb


class LimitError(ValueError):
    """A spec over one of the limits; the message starts with the field's name and names the flag."""


@dataclass(frozen=True)
class SpecLimits:
    max_spec_bytes: int = 256 * 1024
    """A schema's, regex's, grammar's or structural tag's UTF-8 size (`--max-spec-bytes`)."""
    max_schema_depth: int = 128
    """How deep a JSON schema's objects and arrays may nest (`--max-schema-depth`)."""
    max_schema_defs: int = 256
    """`$defs` and `definitions` entries in one schema, all levels together (`--max-schema-defs`)."""
    max_grammar_rules: int = 1024
    """Rules in a Lark or GBNF grammar (`--max-grammar-rules`)."""
    max_tools: int = 128
    """Tools in one OpenAI request (`--max-tools`)."""
    max_tool_schema_bytes: int = 256 * 1024
    """All of one request's tool `parameters` schemas together, as JSON (`--max-tool-schema-bytes`)."""

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value!r}")

    @classmethod
    def unbounded(cls) -> SpecLimits:
        """No limits: for a process that compiles only specs a worker already held to its flags' limits (vLLM's
        logits processor, grammar_processor.py); its native work still runs in a grammar child first."""
        return cls(*(2**62,) * len(cls.__dataclass_fields__))

    @classmethod
    def of(cls, config: Any) -> SpecLimits:
        """The limits a tier's config sets (fields of the same names; the defaults for those it lacks)."""
        return cls(**{name: getattr(config, name) for name in cls.__dataclass_fields__ if hasattr(config, name)})


def check_grammar_settings(config: Any) -> None:
    """A tier's grammar flags (its config's fields of these names) in range; ValueError naming the flag."""
    SpecLimits.of(config)
    if getattr(config, "grammar_processes", 1) < 1:
        raise ValueError(f"--grammar-processes must be >= 1, got {config.grammar_processes}")
    if not getattr(config, "grammar_timeout", 1.0) > 0:
        raise ValueError(f"--grammar-timeout must be > 0 seconds, got {config.grammar_timeout}")
    if getattr(config, "grammar_cache_bytes", 0) < 0:
        raise ValueError(f"--grammar-cache-bytes must be >= 0, got {config.grammar_cache_bytes}")


_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.S)
_OPEN = np.zeros(256, np.int8)
_OPEN[[ord("{"), ord("[")]] = 1
_OPEN[[ord("}"), ord("]")]] = -1
_RULE = re.compile(r"^[ \t]*[?!]?[A-Za-z_][A-Za-z0-9_]*(?:\.-?\d+)?[ \t]*:(?!:)", re.M)


def json_depth(text: str | bytes) -> int:
    """How deep the JSON text's objects and arrays nest (its strings skipped), without recursing or parsing."""
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    brackets = _OPEN[np.frombuffer(_STRING.sub(b"", data), np.uint8)]
    return int(np.cumsum(brackets, dtype=np.int64).max(initial=0))


def grammar_rules(text: str) -> int:
    """Rules a Lark (`name: ...`, each on its own line) or GBNF (`name ::= ...`) grammar defines, at least."""
    return len(_RULE.findall(text)) + text.count("::=")


def count_defs(schema: Any) -> int:
    """`$defs` and `definitions` entries at every level of a parsed schema (walked without recursion)."""
    count, stack = 0, [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key in ("$defs", "definitions"):
                if isinstance(node.get(key), dict):
                    count += len(node[key])
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return count


def value_depth(value: Any) -> int:
    """How deep a parsed JSON value's dicts and lists nest (walked without recursion)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def schema_text(value: Any, where: str, limits: SpecLimits) -> str:
    """A parsed schema (a request body's) as JSON text, refused with LimitError naming `where` when it nests
    deeper than the limit (before `json.dumps` could raise RecursionError)."""
    depth = value_depth(value)
    if depth > limits.max_schema_depth:
        raise LimitError(f"{where}: nests {depth} levels deep; the limit is {limits.max_schema_depth} "
                         "(--max-schema-depth)")
    return json.dumps(value)


def check_json(text: str, where: str, limits: SpecLimits) -> Any:
    """The JSON text parsed, once its bytes and depth are within the limits; its `$defs` counted after.
    LimitError or ValueError (not JSON) naming `where`."""
    check_bytes(text, where, limits)
    depth = json_depth(text)
    if depth > limits.max_schema_depth:
        raise LimitError(f"{where}: nests {depth} levels deep; the limit is {limits.max_schema_depth} "
                         "(--max-schema-depth)")
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"{where}: not valid JSON ({e})") from e
    defs = count_defs(value)
    if defs > limits.max_schema_defs:
        raise LimitError(f"{where}: {defs} $defs/definitions; the limit is {limits.max_schema_defs} "
                         "(--max-schema-defs)")
    return value


def check_bytes(text: str, where: str, limits: SpecLimits) -> None:
    if len(text) * 4 > limits.max_spec_bytes:
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > limits.max_spec_bytes:
            raise LimitError(f"{where}: {size} bytes; the limit is {limits.max_spec_bytes} bytes (--max-spec-bytes)")


def check_spec(spec: gen_pb.StructuredOutput, where: str, limits: SpecLimits) -> None:
    """LimitError (or ValueError: a schema that is not JSON) naming `where` when the spec is over a limit."""
    kind = spec.WhichOneof("kind")
    if kind in (None, "json_object", "choice"):
        return
    text = getattr(spec, kind)
    if kind in ("json_schema", "structural_tag"):
        check_json(text, where, limits)
        return
    check_bytes(text, where, limits)
    if kind == "grammar":
        rules = grammar_rules(text)
        if rules > limits.max_grammar_rules:
            raise LimitError(f"{where}: {rules} rules; the limit is {limits.max_grammar_rules} (--max-grammar-rules)")


def check_tools(tools: list[Any], limits: SpecLimits) -> None:
    """The request's tools within their count and their schemas' total size (each schema's own depth and
    `$defs` are checked as it becomes a spec); LimitError naming `tools`."""
    if len(tools) > limits.max_tools:
        raise LimitError(f"tools: {len(tools)} tools; the limit is {limits.max_tools} (--max-tools)")
    total = 0
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        schema = fn.get("parameters") if isinstance(fn, dict) else None
        if schema is None:
            continue
        text = schema_text(schema, f"tools[{i}].function.parameters", limits)
        total += len(text.encode("utf-8", "surrogatepass"))
        if total > limits.max_tool_schema_bytes:
            raise LimitError(f"tools: their parameters schemas exceed {limits.max_tool_schema_bytes} bytes together "
                             "(--max-tool-schema-bytes)")
