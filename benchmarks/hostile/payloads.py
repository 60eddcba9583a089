"""Hostile payloads as JSON text and protobuf bytes: schemas deep, wide and long, Lark and regex bombs,
huge tool lists, deep JSON, bad UTF-8, integers past int64, NaN.

Deep structures are written as text (Python's json module refuses to write them, and so does no client
that would stop an attacker). `embed` puts such text into a request body in place of a placeholder.
"""

from __future__ import annotations

import json
from typing import Any

RAW = "@@RAW@@"
"""A placeholder string: `embed` replaces its JSON form (quotes included) with raw JSON text."""

BAD = "ZZBADZZ"
"""A 7-byte ASCII placeholder that `bad_bytes` swaps for 7 bytes of invalid UTF-8 inside serialized protobuf."""
INVALID_UTF8 = b"\xff\xfe\xed\xa0\x80\xc3\x28"
"""0xff, 0xfe (never UTF-8), a UTF-8-encoded lone surrogate, a truncated two-byte sequence: 7 bytes."""


LONE = "@@LONE@@"
"""A placeholder string that `lone_surrogates` turns into the JSON escape of a lone surrogate, \\ud800."""


def lone_surrogates(body: dict[str, Any]) -> str:
    """`body` as JSON text with every `LONE` (in keys and values) written as \\ud800."""
    return json.dumps(body).replace(LONE, "\\ud800")


def embed(body: dict[str, Any], raw: str) -> str:
    """`body` as JSON text with its `RAW` placeholder replaced by `raw`."""
    text = json.dumps(body)
    assert f'"{RAW}"' in text, "the body holds no placeholder"
    return text.replace(f'"{RAW}"', raw, 1)


def bad_bytes(serialized: bytes) -> bytes:
    """Serialized protobuf whose `BAD` strings become invalid UTF-8 (same length: the framing holds)."""
    return serialized.replace(BAD.encode(), INVALID_UTF8)


# --- schemas ---------------------------------------------------------------------------------------

def chained_defs(n: int = 700) -> str:
    """n `$defs`, each an object whose required property refers to the next: ~70 KB (issue 38's segfault)."""
    defs = {f"d{i}": {"type": "object", "properties": {"next": {"$ref": f"#/$defs/d{i + 1}"}}, "required": ["next"]}
            for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return json.dumps({"$ref": "#/$defs/d0", "$defs": defs})


def wide_schema(n: int = 10_000) -> str:
    """One object of n required properties."""
    props = {f"p{i}": {"type": "integer"} for i in range(n)}
    return json.dumps({"type": "object", "properties": props, "required": list(props)})


def deep_schema(depth: int = 5_000) -> str:
    """Objects nested `depth` deep (JSON text twice as deep)."""
    return '{"type":"object","properties":{"a":' * depth + '{"type":"string"}' + "}}" * depth


def long_schema(n: int = 3_000) -> str:
    """A long enum of long strings beside a 60 KB pattern."""
    return json.dumps({"type": "object", "properties": {
        "e": {"enum": [f"{i:05d}-" + "x" * 40 for i in range(n)]},
        "s": {"type": "string", "pattern": "(" + "|".join(f"a{i}b" for i in range(8_000)) + ")"},
    }})


SCHEMAS = {"chained_defs": chained_defs, "wide": wide_schema, "deep": deep_schema, "long": long_schema}

# --- grammars --------------------------------------------------------------------------------------

def lark_chain(n: int = 3_000) -> str:
    """n chained Lark rules."""
    rules = "".join(f'r{i}: "a" r{i + 1} | "b"\n' for i in range(n))
    return f"start: r0\n{rules}r{n}: \"c\"\n"


def lark_nested(depth: int = 5_000) -> str:
    """One Lark expression in `depth` parentheses."""
    return "start: " + "(" * depth + '"a"' + ")" * depth + "\n"


def lark_alternatives(n: int = 20_000) -> str:
    return "start: " + " | ".join(f'"w{i}"' for i in range(n)) + "\n"


GRAMMARS = {"lark_chain": lark_chain, "lark_nested": lark_nested, "lark_alternatives": lark_alternatives}

REGEXES = {
    "nested_counts": "((a{1,100}){1,100}){1,100}",
    "alternation": "(" + "|".join(f"w{i}" for i in range(20_000)) + ")",
    "deep_groups": "(" * 3_000 + "a" + ")" * 3_000,
}


def choices(n: int = 20_000) -> list[str]:
    return [f"choice-{i}-" + "y" * 30 for i in range(n)]


# --- tools, deep JSON ------------------------------------------------------------------------------

def tool_list(n: int = 1_000, properties: int = 50) -> list[dict[str, Any]]:
    params = {"type": "object", "properties": {f"arg{j}": {"type": "string", "description": "d" * 40}
                                                for j in range(properties)}}
    return [{"type": "function", "function": {"name": f"tool_{i}", "description": "t" * 100, "parameters": params}}
            for i in range(n)]


def deep_array(depth: int = 10_000) -> str:
    return "[" * depth + "1" + "]" * depth


def deep_object(depth: int = 10_000) -> str:
    return '{"a":' * depth + "1" + "}" * depth


# --- protobuf wire bytes ---------------------------------------------------------------------------

def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def field(number: int, wire_type: int, payload: bytes = b"") -> bytes:
    """One protobuf field: a LEN field (wire type 2) gets its length prefix."""
    tag = varint(number << 3 | wire_type)
    return tag + (varint(len(payload)) + payload if wire_type == 2 else payload)


MALFORMED = {
    "truncated": field(2, 2, b"hello")[:-2],
    "length_past_end": varint(2 << 3 | 2) + varint(2**31) + b"abc",
    "varint_11_bytes": varint(4 << 3 | 0) + b"\xff" * 10 + b"\x01",
    "wire_type_7": bytes([(1 << 3) | 7]) + b"\x00" * 8,
    "groups_200_deep": bytes([(15 << 3) | 3]) * 200 + bytes([(15 << 3) | 4]) * 200,
    "unmatched_end_group": bytes([(15 << 3) | 4]),
    "field_number_0": bytes([0 << 3 | 0, 1]),
    "text_invalid_utf8": field(2, 2, INVALID_UTF8),
    "sampling_wrong_wire_type": field(4, 0, varint(5)),
    "packed_ids_ragged": field(3, 2, field(1, 2, b"\xff\xff\xff")),
    "random": bytes((i * 2654435761) & 0xFF for i in range(997)),
}
