"""Tool calls in a model's free text (`tool_choice: "auto"`), by the format its chat template teaches it:
vLLM's `--tool-call-parser` names. Each parser returns the text outside the calls (None when there is
none) and the calls, (name, arguments as JSON text); text that does not parse stays content."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

Call = tuple[str, str]
"""(function name, arguments as JSON text)."""

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def _call(obj: Any, arguments_key: str = "arguments") -> Call | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(arguments_key, obj.get("parameters", obj.get("arguments", {})))
    return obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def _content(text: str) -> str | None:
    return text if text.strip() else None


def hermes(text: str) -> tuple[str | None, list[Call]]:
    """Hermes / Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number of them."""
    if "<tool_call>" not in text:
        return text, []
    calls = []
    for body in _HERMES.findall(text):
        try:
            call = _call(json.loads(body))
        except json.JSONDecodeError:
            return text, []
        if call is None:
            return text, []
        calls.append(call)
    return _content(text[: text.index("<tool_call>")]), calls


def llama3_json(text: str) -> tuple[str | None, list[Call]]:
    """Llama 3.1+: `{"name": ..., "parameters": {...}}` (after `<|python_tag|>` or alone), several joined by `;`."""
    body = text.split("<|python_tag|>", 1)[1] if "<|python_tag|>" in text else text
    body = body.strip()
    if not body.startswith("{"):
        return text, []
    decoder, calls, at = json.JSONDecoder(), [], 0
    try:
        while at < len(body):
            obj, at = decoder.raw_decode(body, at)
            call = _call(obj, "parameters")
            if call is None:
                return text, []
            calls.append(call)
            at = len(body) - len(body[at:].lstrip().lstrip(";").lstrip())
    except json.JSONDecodeError:
        return text, []
    prefix = text.split("<|python_tag|>", 1)[0] if "<|python_tag|>" in text else ""
    return _content(prefix), calls


def mistral(text: str) -> tuple[str | None, list[Call]]:
    """Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`."""
    if "[TOOL_CALLS]" not in text:
        return text, []
    before, after = text.split("[TOOL_CALLS]", 1)
    try:
        items = json.loads(after.strip())
    except json.JSONDecodeError:
        return text, []
    items = items if isinstance(items, list) else [items]
    calls = [_call(i) for i in items]
    if not calls or any(c is None for c in calls):
        return text, []
    return _content(before), calls  # type: ignore[return-value]


MARKERS = {"hermes": "<tool_call>", "llama3_json": "<|python_tag|>", "mistral": "[TOOL_CALLS]"}
"""Where each format's calls begin: text before it is content, and may stream as it comes."""


def content_so_far(parser: str, text: str) -> int:
    """How many leading characters of a still-growing `text` are content whatever follows: up to the
    parser's marker, or to a tail that may be its beginning (llama3_json: none while the text may be a bare
    JSON call)."""
    if parser == "llama3_json" and text.lstrip()[:1] in ("", "{"):
        return 0
    marker = MARKERS[parser]
    at = text.find(marker)
    if at >= 0:
        return at
    for keep in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-keep:]):
            return len(text) - keep
    return len(text)


PARSERS: dict[str, Callable[[str], tuple[str | None, list[Call]]]] = {
    "hermes": hermes, "llama3_json": llama3_json, "mistral": mistral,
}
