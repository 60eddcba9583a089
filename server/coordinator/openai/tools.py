"""OpenAI tools: which calls a chat may answer with (`ToolPlan`), the grammar that holds `required` and a
named choice to the functions' `parameters`, and the answer's `message.tool_calls`.

- `tools`: rendered through the chat template's `tools` variable; their number and schemas' bytes within the
  limits (limits.py), each `parameters` schema checked by a grammar child (`check_tools`, awaited).
- `tool_choice` "none": free text, never parsed. "auto" (the default with tools; needs
  `--enable-auto-tool-choice` and `--tool-call-parser`): free text, its calls parsed out (tool_parsers.py).
  "required": a JSON array of one or more `{"name", "parameters"}` calls (one when `parallel_tool_calls` is
  false), each name one of the tools' and its parameters fitting that function's schema, enforced token by
  token. A named function: its arguments alone, enforced by its schema.
Calls come back with ids and finish_reason `tool_calls`.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from dataclasses import dataclass
from typing import Any, Literal

from pdserve.v1 import generation_pb2
from pdserve.server.coordinator.openai.errors import ApiError
from pdserve.server.coordinator.openai.structured import check_structured
from pdserve.server.coordinator.openai.tool_parsers import PARSERS, Call, content_so_far
from pdserve.server.structured.limits import SpecLimits, check_spec, check_tools, schema_text

Mode = Literal["none", "auto", "required", "named"]
ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class ToolPlan:
    mode: Mode
    tools: list[dict[str, Any]]
    """As the request gave them: what the chat template renders."""
    schemas: dict[str, dict[str, Any]]
    """Each function's parameters schema, by name."""
    named: str | None = None
    parallel: bool = True
    parser: str | None = None

    def structured(self) -> generation_pb2.StructuredOutput | None:
        """The grammar of `required` and named choices (None: free text)."""
        if self.mode == "named":
            return generation_pb2.StructuredOutput(json_schema=json.dumps(self.schemas[self.named]))
        if self.mode == "required":
            return generation_pb2.StructuredOutput(json_schema=json.dumps(required_schema(self.schemas, self.parallel)))
        return None

    def calls(self, text: str) -> tuple[str | None, list[Call]]:
        """The answer's content and calls, from its whole text."""
        if self.mode == "named":
            return None, [(self.named, text)]
        if self.mode == "required":
            try:
                items = json.loads(text)
            except json.JSONDecodeError:
                return text, []
            return None, [(i["name"], json.dumps(i["parameters"], ensure_ascii=False)) for i in items]
        if self.mode == "auto" and self.parser is not None:
            return PARSERS[self.parser](text)
        return text, []


    def streamable(self, text: str) -> int:
        """How many leading characters of a growing answer can stream as content now (auto: those before
        any call can begin; required and named answers are calls only)."""
        if self.mode == "auto" and self.parser is not None:
            return content_so_far(self.parser, text)
        return len(text) if self.mode == "none" else 0


def required_schema(schemas: dict[str, dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """A JSON array of calls, each naming a function and giving parameters that fit its schema."""
    calls = [{"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
              "required": ["name", "parameters"], "additionalProperties": False}
             for name, schema in schemas.items()]
    out: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        out["maxItems"] = 1
    return out


def tool_plan(tools: list[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None,
              auto_enabled: bool, parser: str | None, limits: SpecLimits | None = None) -> ToolPlan | None:
    """The request's plan (None: no tools); ApiError 400 naming the field when it cannot be served or its tools
    are over the `limits` (plain Python: the schemas' grammars are `check_tools`')."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise ApiError(400, "tool_choice: needs tools", param="tool_choice")
        return None
    limits = limits or SpecLimits()
    try:
        check_tools(tools, limits)
    except ValueError as e:
        raise ApiError(400, str(e), param=str(e).partition(":")[0]) from e
    schemas: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ApiError(400, f'tools[{i}]: a tool is {{"type": "function", "function": {{"name", "parameters"}}}}',
                           param=f"tools[{i}]")
        schema = fn.get("parameters") or ANY_OBJECT
        where = f"tools[{i}].function.parameters"
        if not isinstance(schema, dict):
            raise ApiError(400, f"{where}: a JSON schema is an object", param=where)
        try:
            check_spec(generation_pb2.StructuredOutput(json_schema=schema_text(schema, where, limits)), where, limits)
        except ValueError as e:
            raise ApiError(400, str(e), param=where) from e
        schemas[fn["name"]] = schema
    parallel = parallel_tool_calls is not False
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if not isinstance(name, str):
            raise ApiError(400, 'tool_choice: {"type": "function", "function": {"name": ...}} names a function',
                           param="tool_choice")
        if name not in schemas:
            raise ApiError(400, f"tool_choice: function {name!r} is not among the tools ({', '.join(schemas)})",
                           param="tool_choice")
        return ToolPlan("named", tools, schemas, named=name, parallel=parallel)
    if choice not in ("none", "auto", "required"):
        raise ApiError(400, f'tool_choice: {choice!r}; one of "none", "auto", "required" or a named function',
                       param="tool_choice")
    if choice == "auto" and not (auto_enabled and parser):
        raise ApiError(400, 'tool_choice: "auto" needs the server started with --enable-auto-tool-choice and '
                            '--tool-call-parser', param="tool_choice")
    return ToolPlan(choice, tools, schemas, parallel=parallel, parser=parser)


async def check_tools_grammar(plan: ToolPlan | None, generation: Any) -> None:
    """Each tool's `parameters` schema checked by a grammar child of the coordinator, all at once (a schema
    seen before is not checked again); ApiError 400 naming the first tool that fails."""
    if plan is None:
        return
    where = {name: f"tools[{i}].function.parameters" for i, tool in reversed(list(enumerate(plan.tools)))
             if (name := (tool.get("function") or {}).get("name")) in plan.schemas}
    await asyncio.gather(*(check_structured(generation, generation_pb2.StructuredOutput(json_schema=json.dumps(schema)),
                                            where[name])
                           for name, schema in plan.schemas.items()))


def tool_call(call: Call) -> dict[str, Any]:
    """One call as OpenAI's `message.tool_calls` has it, with a fresh id."""
    name, arguments = call
    return {"id": f"chatcmpl-tool-{secrets.token_hex(12)}", "type": "function",
            "function": {"name": name, "arguments": arguments}}
