"""A client's JSON (an OpenAI body, KServe's sampling_parameters): parsed, then checked once for what Python
or protobuf cannot hand on, so that no later step fails on it with an exception the client would see as a 500.

- `parse_json(raw, field)`: the value, or `JsonRefused` ("<field>: not valid JSON ..."); a document nested
  too deep for the parser is refused the same way (its RecursionError never escapes).
- `check_json(value, field)`: walks the value iteratively (no recursion, whatever its depth) and refuses,
  naming the path (`messages[0].content`): nesting deeper than `MAX_JSON_DEPTH`; a string or key that is not
  encodable as UTF-8 (a lone surrogate: `"\\ud800"` is valid JSON); an integer outside [-2**63, 2**64) (no
  protobuf field holds it); a float that is NaN or infinite (Python's json reads `NaN`, `Infinity`).
  Narrower ranges (int32 fields, the vocabulary) are the field's own check, where it is read.
- `printable(text)`: any string made safe to quote in a message (lone surrogates escaped).

Both run off the event loop for a large body (`parse_checked`, `OFF_LOOP_BYTES`).
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

MAX_JSON_DEPTH = 128
"""The deepest nesting of arrays and objects a request may hold (a JSON schema 60 properties deep fits)."""
INT_MIN, INT_MAX = -(2**63), 2**64 - 1
"""The widest integers a protobuf field holds (int64's low end, uint64's high end)."""
OFF_LOOP_BYTES = 64 * 1024
"""Bodies larger than this are parsed and checked in a thread (about a millisecond of work and up)."""


class JsonRefused(ValueError):
    """The client's JSON cannot be served; the message names the field and starts with it."""

    def __init__(self, message: str, field: str | None):
        super().__init__(message)
        self.field = field


def printable(text: str) -> str:
    """`text` with anything UTF-8 cannot encode (lone surrogates) written as a `\\udXXX` escape."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def parse_json(raw: bytes | str, field: str | None = None) -> Any:
    """The JSON value of `raw`, or JsonRefused naming `field` (None: the request body)."""
    name = field or "body"
    try:
        return json.loads(raw)
    except RecursionError:
        raise JsonRefused(f"{name}: nested too deep to parse; at most {MAX_JSON_DEPTH} levels", field) from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer over Python's 4300 digits
        what = "the request body" if field is None else field
        raise JsonRefused(f"{what} is not valid JSON: {e}", field) from None


def check_json(value: Any, field: str | None = None) -> None:
    """Raises JsonRefused naming the first path at fault (see the module's docstring); iterative, and a path
    is only spelled out for a container or a fault (a prompt of a million token ids costs one pass)."""
    if not isinstance(value, (dict, list)):
        _check_scalar(value, field or "")
        return
    stack: list[tuple[Any, str, int]] = [(value, field or "", 1)]
    while stack:
        item, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise JsonRefused(f"{_shown(path)}: nested deeper than {MAX_JSON_DEPTH} levels", _shown(path, None))
        is_dict = isinstance(item, dict)
        if not is_dict and len(item) > 16 and set(map(type, item)) == {int}:  # token ids: at C speed
            low, high = min(item), max(item)
            if low < INT_MIN or high > INT_MAX:
                bad = low if low < INT_MIN else high
                _check_scalar(bad, f"{path}[{item.index(bad)}]")
            continue
        for key, inner in (item.items() if is_dict else enumerate(item)):
            if is_dict and not key.isascii():
                _check_text(key, path, key=True)
            kind = type(inner)
            if kind is str:
                if not inner.isascii():
                    _check_text(inner, _child(path, key, is_dict))
            elif kind is dict or kind is list:
                stack.append((inner, _child(path, key, is_dict), depth + 1))
            elif kind is not bool and inner is not None:
                _check_scalar(inner, _child(path, key, is_dict))


def _child(path: str, key: Any, is_dict: bool) -> str:
    if not is_dict:
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def _shown(path: str, empty: str | None = "body") -> str | None:
    """A path as an error names it: printable, long ones cut in the middle."""
    if not path:
        return empty
    path = printable(path)
    return path if len(path) <= 160 else f"{path[:80]}...{path[-77:]}"


def _check_scalar(item: Any, path: str) -> None:
    if isinstance(item, str):
        if not item.isascii():
            _check_text(item, path)
    elif isinstance(item, bool) or item is None:
        return
    elif isinstance(item, int):
        if not INT_MIN <= item <= INT_MAX:
            raise JsonRefused(f"{_shown(path)}: the integer {_short(item)} lies outside [-2**63, 2**64)",
                              _shown(path, None))
    elif isinstance(item, float):
        if not math.isfinite(item):
            raise JsonRefused(f"{_shown(path)}: {item} is not a finite number", _shown(path, None))


async def parse_checked(raw: bytes, field: str | None = None) -> Any:
    """parse_json then check_json, in a thread when `raw` is large."""
    if len(raw) > OFF_LOOP_BYTES:
        return await asyncio.to_thread(_parse_checked, raw, field)
    return _parse_checked(raw, field)


def _parse_checked(raw: bytes, field: str | None) -> Any:
    value = parse_json(raw, field)
    check_json(value, field)
    return value


def _check_text(text: str, path: str, key: bool = False) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        what = "a key" if key else "the string"
        raise JsonRefused(
            f"{_shown(path)}: {what} holds {printable(text[e.start:e.end])} at character {e.start}, a lone "
            "surrogate UTF-8 cannot encode; send valid Unicode", _shown(path, None)) from None


def _short(n: int) -> str:
    return str(n) if n.bit_length() <= 128 else f"of {n.bit_length()} bits"
