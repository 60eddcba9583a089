"""Chat messages to prompt token ids through the model's own chat template, as `transformers` renders it.

The template comes from `chat_template.jinja` or `tokenizer_config.json`'s `chat_template` (a string,
or a list of named templates: "default" is used), or `--chat-template`. It is rendered in the
environment `transformers`' `apply_chat_template` builds (a sandboxed jinja2 environment with
trim_blocks/lstrip_blocks, loop controls, `{% generation %}`, its `tojson`, `raise_exception` and
`strftime_now`), with `messages`, `tools`, `documents`, `add_generation_prompt`, the special tokens and
`chat_template_kwargs`, then tokenized without adding special tokens (the template writes the BOS
itself where the model wants one). tests/coordinator/test_chat_template.py holds the two to the same text.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HfTokenizer

from pdserve.server.model.tokenizer import GIL_FREE_CHARS

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
"""A message's reasoning, under any of these names, reaches the template under all of them (as transformers does)."""


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (bad shape, or the template itself refuses them)."""


def _token_content(value: Any) -> str:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """transformers' `tojson` filter: its arguments, in its order; no HTML escaping."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationBlocks(Extension):
    """`{% generation %}...{% endgeneration %}` (transformers marks assistant text so): rendered as is."""

    tags = {"generation"}

    def parse(self, parser):  # type: ignore[no-untyped-def]
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):  # type: ignore[no-untyped-def]
        return caller()


def _read_template(model_dir: Path) -> tuple[str | None, dict[str, Any]]:
    cfg_path = model_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.exists():
        return jinja_file.read_text(), cfg
    template = cfg.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return (template if isinstance(template, str) and template else None), cfg


def _template_or_file(value: str) -> str:
    """`--chat-template`: a path to a template file, or the template itself (as vLLM takes it)."""
    try:
        if Path(value).is_file():
            return Path(value).read_text()
    except OSError:  # a long template is no file name
        pass
    return value


def _tool_calls(calls: Any) -> Any:
    """An assistant message's tool calls as templates read them: each call's `arguments`, which OpenAI sends
    as JSON text, as the object it holds (as vLLM passes them; templates `tojson` or iterate it)."""
    if not isinstance(calls, list):
        return calls
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:
                arguments = json.loads(fn["arguments"])
            except json.JSONDecodeError:
                arguments = None
            if isinstance(arguments, dict):
                call = {**call, "function": {**fn, "arguments": arguments}}
        out.append(call)
    return out


def normalize_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """OpenAI messages to what templates expect: `content` a string (text parts joined), tool calls'
    arguments objects."""
    if not messages:
        raise ChatTemplateError("messages must hold at least one message")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ChatTemplateError(f"messages[{i}] must be an object with 'role' and 'content'")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ChatTemplateError(f"messages[{i}].role must be a string naming the speaker; got {role!r}")
        content = message.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if (
                    not isinstance(part, dict)
                    or part.get("type") != "text"
                    or not isinstance(part.get("text"), str)
                ):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise ChatTemplateError(
                        f"messages[{i}].content[{j}]: only text parts are supported, got {kind!r}"
                    )
                parts.append(part["text"])
            content = "".join(parts)
        elif not isinstance(content, str):
            raise ChatTemplateError(f"messages[{i}].content must be a string or a list of text parts")
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        if "tool_calls" in message:
            message = {**message, "tool_calls": _tool_calls(message["tool_calls"])}
        out.append({**message, "content": content})
    return out


class ChatTemplate:
    def __init__(self, template: str, encoder: HfTokenizer, special_tokens: dict[str, str]):
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", _GenerationBlocks]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(template)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"the model's chat template does not parse: {e}") from e
        self._encoder = encoder
        self.special_tokens = special_tokens

    @classmethod
    def from_dir(cls, model_dir: str | Path, encoder: HfTokenizer | None = None,
                 override: str | None = None) -> ChatTemplate | None:
        """None when the model has no chat template (a base model). `encoder`: tokenizer.json, if loaded.
        `override` (`--chat-template`): a template, or a file holding one, used instead of the model's."""
        model_dir = Path(model_dir)
        template, cfg = _read_template(model_dir)
        if override:
            template = _template_or_file(override)
        if template is None:
            return None
        encoder = encoder or HfTokenizer.from_file(str(model_dir / "tokenizer.json"))
        special = {name: _token_content(cfg.get(name)) for name in SPECIAL_TOKENS}
        return cls(template, encoder, special)

    def render(self, messages: list[Any], add_generation_prompt: bool = True,
               template_kwargs: dict[str, Any] | None = None, tools: list[dict[str, Any]] | None = None) -> str:
        """`template_kwargs`: extra template variables (`chat_template_kwargs`, e.g. enable_thinking);
        `tools`: JSON schemas of the functions the model may call."""
        context = {"add_generation_prompt": add_generation_prompt, "tools": tools, "documents": None,
                   **self.special_tokens, **(template_kwargs or {})}
        context["messages"] = normalize_messages(messages)
        try:
            return self._template.render(**context)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template cannot render these messages: {e}") from e

    def encode(self, messages: list[Any], template_kwargs: dict[str, Any] | None = None,
               tools: list[dict[str, Any]] | None = None) -> tuple[str, list[int]]:
        """The rendered prompt and its token ids (no special tokens added: the template has them)."""
        text = self.render(messages, template_kwargs=template_kwargs, tools=tools)
        if len(text) > GIL_FREE_CHARS:  # releases the GIL (tokenizer.py): the caller's thread leaves the loop free
            return text, self._encoder.encode_batch([text], add_special_tokens=False)[0].ids
        return text, self._encoder.encode(text, add_special_tokens=False).ids
