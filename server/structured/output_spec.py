"""A StructuredOutput as the llguidance grammar every tier compiles, and the refusal of one that is not valid.

Every function here runs llguidance on the client's text: only a grammar child (child.py) calls them on a spec
that has not passed one (checker.py). There the spec is checked (no tokenizer needed: the grammar's syntax, the
schema's keywords, the regex) and refused naming the field; the workers compile it against their tokenizer
(grammars.py) and refuse what still fails, whoever sent it. The spec's sizes are limits.py's, checked first. JSON is compact: no whitespace between tokens, so a weak or random
model cannot spend its budget on spaces (llguidance's `whitespace_flexible` off).
"""

from __future__ import annotations

import json

import llguidance
from pdserve.v1 import generation_pb2 as gen_pb

MAX_CHOICES = 1024
JSON_OPTIONS = {"whitespace_flexible": False}
"""Compact JSON: "," and ":" with no whitespace around them."""
ANY_JSON_OBJECT = {"type": "object"}


class SpecError(ValueError):
    """A StructuredOutput that cannot be enforced; the message starts with the field's name."""


def kind_of(spec: gen_pb.StructuredOutput) -> str | None:
    return spec.WhichOneof("kind")


def grammar_of(spec: gen_pb.StructuredOutput, field: str = "structured", where: str | None = None) -> str:
    """The llguidance grammar text of a set spec; SpecError naming `where` (default `field.<kind>`) when it
    cannot be built."""
    kind = kind_of(spec)
    where = where or f"{field}.{kind}"
    text = "" if kind in (None, "json_object", "choice") else getattr(spec, kind)
    try:
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(ANY_JSON_OBJECT, defaults=JSON_OPTIONS)
        if kind == "json_schema":
            schema = json.loads(text)
            if not isinstance(schema, (dict, bool)):
                raise SpecError(f"{where}: a JSON schema is an object, got {type(schema).__name__}")
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(text)
        if kind == "choice":
            choices = list(spec.choice.choices)
            if not choices or len(choices) > MAX_CHOICES or any(not c for c in choices):
                raise SpecError(f"{where}: 1 to {MAX_CHOICES} non-empty strings are needed, got {len(choices)}")
            return llguidance.grammar_from("choice", choices)
        if kind == "grammar":
            return llguidance.grammar_from("grammar", text)
        if kind == "structural_tag":
            return _structural_tag(json.loads(text), where)
    except json.JSONDecodeError as e:
        raise SpecError(f"{where}: not valid JSON ({e})") from e
    except (ValueError, TypeError, AssertionError) as e:
        if isinstance(e, SpecError):
            raise
        raise SpecError(f"{where}: {e}") from e
    raise SpecError(f"{field}: no kind is set")


def spec_problem(spec: gen_pb.StructuredOutput, field: str = "structured", where: str | None = None) -> str | None:
    """Why the spec cannot be enforced (a sentence starting with `where`, by default `field.<kind>`), or None;
    no tokenizer needed."""
    where = where or f"{field}.{kind_of(spec)}"
    try:
        grammar = grammar_of(spec, field, where)
    except SpecError as e:
        return str(e)
    error = llguidance.LLMatcher.validate_grammar(grammar)
    return f"{where}: {one_line(error)}" if error else None


def one_line(error: str, limit: int = 400) -> str:
    """llguidance's multi-line error as one line, at most `limit` characters."""
    text = " ".join(line.strip() for line in error.strip().splitlines() if line.strip())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _structural_tag(tag: dict, where: str) -> str:
    """vLLM's structural_tag {"structures": [{"begin", "schema", "end"}], "triggers": [...]}: free text with
    each structure, once it begins, held to its schema."""
    if not isinstance(tag, dict) or not isinstance(tag.get("structures"), list) or not tag["structures"]:
        raise SpecError(f'{where}: needs "structures": [{{"begin", "schema", "end"}}, ...] and "triggers"')
    triggers = [t for t in tag.get("triggers", []) if isinstance(t, str) and t]
    tags = []
    for i, s in enumerate(tag["structures"]):
        begin = s.get("begin", "") if isinstance(s, dict) else ""
        trigger = next((t for t in triggers if begin.startswith(t)), None)
        if trigger is None:
            raise SpecError(f"{where}.structures[{i}]: its begin {begin!r} starts with none of the triggers")
        tags.append(llguidance.StructTag(trigger=trigger, begin=begin, grammar=s.get("schema", ANY_JSON_OBJECT),
                                         end=s.get("end", "")))
    return llguidance.StructTag.to_grammar(tags, assume_special=False)
