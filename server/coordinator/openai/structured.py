"""OpenAI's `response_format` and vLLM's `structured_outputs` as the StructuredOutput the tiers enforce.

response_format: {"type": "text"} (free), {"type": "json_object"}, {"type": "json_schema", "json_schema":
{"name", "schema", "strict", "description"}} and vLLM's {"type": "structural_tag", ...}. structured_outputs
(vLLM's extra parameter, on chat and completions): exactly one of json (a schema, as an object or JSON text),
json_object, regex, choice, grammar (EBNF or Lark), structural_tag. Each refusal is a 400 naming the field:
the shape here, the grammar itself by `check_structured` (awaited: a grammar child of the coordinator checks it).
"""

from __future__ import annotations

import json
from typing import Any

from pdserve.v1 import generation_pb2
from pdserve.server.coordinator.admission import RequestFailed
from pdserve.server.coordinator.openai.errors import ApiError, api_error
from pdserve.server.coordinator.validate import InvalidRequest

StructuredOutput = generation_pb2.StructuredOutput
KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
"""structured_outputs' constraints, one of which a request may set."""
OPTIONS = ("disable_fallback", "disable_any_whitespace", "disable_additional_properties", "whitespace_pattern")
"""vLLM's structured_outputs options pdserve accepts: JSON is compact and exact here already (no fallback, no
whitespace), so only their values that agree with that are taken."""


def structured_output(response_format: dict[str, Any] | None,
                      structured_outputs: dict[str, Any] | None) -> StructuredOutput | None:
    """The request's constraint (None: free text), its shape checked; ApiError 400 naming the field otherwise.
    The grammar itself is `check_structured`'s."""
    spec = None
    if response_format is not None:
        spec = _response_format(response_format)
    if structured_outputs is not None:
        if spec is not None:
            raise ApiError(400, "structured_outputs: set it or response_format, not both", param="structured_outputs")
        spec = _structured_outputs(structured_outputs)
    return spec


def structured_where(response_format: dict[str, Any] | None, structured_outputs: dict[str, Any] | None) -> str | None:
    """The field a refusal of the request's constraint names."""
    if response_format is not None and response_format.get("type") != "text":
        where = f"response_format.{response_format.get('type')}"
        return where + ".schema" if where == "response_format.json_schema" else where
    if structured_outputs is not None:
        return "structured_outputs." + next((k for k in KINDS if structured_outputs.get(k) not in (None, False)), "")
    return None


async def check_structured(generation: Any, spec: StructuredOutput, where: str | None) -> None:
    """The constraint checked by a grammar child process of the coordinator (`GenerationService.check_spec`:
    limits, then llguidance in the child), the event loop free meanwhile; ApiError 400 naming `where`."""
    if spec.WhichOneof("kind"):
        try:
            await generation.check_spec(spec, where)
        except InvalidRequest as e:
            raise ApiError(400, str(e), param=where) from e
        except RequestFailed as e:  # the grammar processes are overloaded: 429, retry
            raise api_error(e) from e


def schema_json(schema: Any, where: str) -> str:
    """A parsed schema as JSON text; a 400 naming `where` when it nests too deep to be written."""
    try:
        return json.dumps(schema)
    except RecursionError as e:
        raise ApiError(400, f"{where}: nests too deep", param=where) from e


def _response_format(rf: dict[str, Any]) -> StructuredOutput | None:
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(json_object=True)
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or "schema" not in js and "json_schema" not in js:
            raise ApiError(400, 'response_format.json_schema: needs {"name", "schema"}',
                           param="response_format.json_schema")
        schema = js.get("schema", js.get("json_schema"))
        if not isinstance(schema, (dict, bool)):
            raise ApiError(400, "response_format.json_schema.schema: a JSON schema is an object",
                           param="response_format.json_schema.schema")
        return StructuredOutput(json_schema=schema_json(schema, "response_format.json_schema.schema"))
    if kind == "structural_tag":
        return StructuredOutput(structural_tag=schema_json({k: v for k, v in rf.items() if k != "type"},
                                                           "response_format.structural_tag"))
    raise ApiError(400, f"response_format.type: {kind!r}; one of text, json_object, json_schema, structural_tag",
                   param="response_format.type")


def _structured_outputs(so: dict[str, Any]) -> StructuredOutput:
    for name, value in so.items():
        if name not in KINDS + OPTIONS:
            raise ApiError(400, f"structured_outputs.{name}: unknown; one of {', '.join(KINDS)}",
                           param=f"structured_outputs.{name}")
        if name in ("disable_additional_properties", "whitespace_pattern") and value not in (None, False):
            raise ApiError(400, f"structured_outputs.{name}: not supported", param=f"structured_outputs.{name}")
    given = [k for k in KINDS if so.get(k) not in (None, False)]
    if len(given) != 1:
        raise ApiError(400, f"structured_outputs: set exactly one of {', '.join(KINDS)}; got "
                            f"{', '.join(given) or 'none'}", param="structured_outputs")
    kind = given[0]
    value = so[kind]
    field = f"structured_outputs.{kind}"
    if kind == "json":
        if isinstance(value, str):
            return StructuredOutput(json_schema=value)
        if not isinstance(value, dict):
            raise ApiError(400, f"{field}: a JSON schema (an object or its JSON text)", param=field)
        return StructuredOutput(json_schema=schema_json(value, field))
    if kind == "json_object":
        return StructuredOutput(json_object=True)
    if kind == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise ApiError(400, f"{field}: a list of strings", param=field)
        return StructuredOutput(choice=generation_pb2.Choices(choices=value))
    if kind == "structural_tag":
        return StructuredOutput(structural_tag=value if isinstance(value, str) else schema_json(value, field))
    if not isinstance(value, str):
        raise ApiError(400, f"{field}: a string", param=field)
    return StructuredOutput(**{kind: value})
