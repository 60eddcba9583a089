"""argparse flags generated from a config dataclass: defaults, types, choices and help live on the
fields, once.

A field becomes `--field-name` (underscores to dashes) unless its metadata (`flag(...)`) names other
spellings; its help is the field's docstring (the string literal under it); `Literal[...]` gives
choices, `bool` a switch, `list[str]` a repeatable flag, `tuple[str, ...]` one or more values.
`config_from_args` builds the dataclass back (which validates it) from the parsed namespace, and
`config_to_argv` writes a config out as the flags that parse back to it (`pdserve up` starting its tiers).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import textwrap
import types
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal, get_args, get_origin


def flag(*names: str, help: str | None = None, cli: bool = True, **argparse_kw: Any) -> dict[str, Any]:
    """Field metadata: the flag's spellings (the first is canonical), or cli=False to leave it out."""
    return {"flag": {"names": names, "help": help, "cli": cli, "kw": argparse_kw}}


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring: the string literal right under its annotation. Parsed once per class:
    CPython 3.11.7's ast.parse can raise a spurious "AST constructor recursion depth mismatch"
    SystemError while another thread parses (gh-106905, fixed in 3.11.8)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, after in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _unoptional(tp: Any) -> Any:
    if get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


_NO_SPEC = {"names": (), "help": None, "cli": True, "kw": {}}


def _spec(f: dataclasses.Field) -> dict[str, Any]:
    return f.metadata.get("flag", _NO_SPEC)


def _names(f: dataclasses.Field) -> tuple[str, ...]:
    """The field's flag spellings, the canonical one first."""
    return _spec(f)["names"] or (f"--{f.name.replace('_', '-')}",)


def _default(f: dataclasses.Field, defaults: dict[str, Any] | None) -> Any:
    """The parser's default for the field: `defaults`' override, else the field's (MISSING: none)."""
    if defaults and f.name in defaults:
        return defaults[f.name]
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def _flagged(cls: type, skip: Iterable[str], only: Iterable[str] | None) -> list[dataclasses.Field]:
    """The fields that get a flag: cli ones, less `skip`, and of those only `only` when given."""
    only = None if only is None else set(only)
    return [f for f in dataclasses.fields(cls)
            if _spec(f)["cli"] and f.name not in skip and (only is None or f.name in only)]


def add_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type, *,
              skip: Iterable[str] = (), only: Iterable[str] | None = None,
              defaults: dict[str, Any] | None = None, prefix: str = "") -> None:
    """One flag per field of the dataclass `cls` (but `skip` and cli=False ones; only `only`'s when
    given); `defaults` overrides a field's default for this parser (e.g. the port a role listens on);
    `prefix` names one tier's fields in a command for several (`pdserve up --decode-device`, dest
    decode_device, is the decode tier's `--device`)."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in _flagged(cls, skip, only):
        spec = _spec(f)
        names = [f"--{prefix}-{name[2:]}" for name in _names(f)] if prefix else _names(f)
        kw: dict[str, Any] = {"dest": f"{prefix}_{f.name}" if prefix else f.name,
                              "help": spec["help"] or docs.get(f.name)}
        tp = _unoptional(hints[f.name])
        default = _default(f, defaults)
        if default is dataclasses.MISSING:
            default = None
            kw["required"] = True
        if tp is bool:
            kw["action"] = argparse.BooleanOptionalAction if default else "store_true"
        elif get_origin(tp) is Literal:
            kw["choices"] = list(get_args(tp))
        elif get_origin(tp) is list:
            kw.update(action="append", type=get_args(tp)[0])
            default = list(default or [])
        elif get_origin(tp) is tuple:
            kw.update(nargs="+", type=get_args(tp)[0])
        elif tp in (int, float, str, Path):
            kw["type"] = tp
        if default is not None and "help" in kw and kw["help"] is not None and not kw.get("required"):
            kw["help"] += f" (default: {default if not isinstance(default, (list, tuple)) else ' '.join(map(str, default)) or 'none'})"
        kw.update(spec["kw"])
        parser.add_argument(*names, default=default, **kw)


def config_from_args(cls: type, args: argparse.Namespace, *, only: Iterable[str] | None = None,
                     **overrides: Any) -> Any:
    """The dataclass from the parsed flags (fields without a flag keep their defaults; with `only`,
    every field but those and `overrides` does)."""
    names = [f.name for f in dataclasses.fields(cls) if only is None or f.name in only]
    values = {name: getattr(args, name) for name in names if hasattr(args, name)}
    values.update(overrides)
    return cls(**values)


def config_to_argv(config: Any, *, only: Iterable[str] | None = None,
                   defaults: dict[str, Any] | None = None) -> list[str]:
    """The flags from which the parser `add_flags(parser, type(config), defaults=defaults)` builds `config`
    back: one for each field (of `only`, when given) whose value is not the parser's default, in its
    canonical spelling. Fields without a flag (cli=False: the model, the metrics port) are the caller's.
    A value no flag can spell (None, or an empty tuple, over a default that is neither) is a ValueError."""
    hints = typing.get_type_hints(type(config))
    argv: list[str] = []
    for f in _flagged(type(config), (), only):
        value, default = getattr(config, f.name), _default(f, defaults)
        if value == default:
            continue
        name, tp = _names(f)[0], _unoptional(hints[f.name])
        if tp is bool:
            argv.append(name if value else f"--no-{name[2:]}")  # BooleanOptionalAction's negation
        elif get_origin(tp) is list:
            argv += [part for item in value for part in (name, str(item))]
        elif value is None or (get_origin(tp) is tuple and not value):
            raise ValueError(f"{name}: {value!r} has no spelling on the command line (its default is {default!r})")
        elif get_origin(tp) is tuple:
            argv += [name, *map(str, value)]
        elif str(value).startswith("-"):
            argv.append(f"{name}={value}")  # a value argparse would otherwise read as a flag
        else:
            argv += [name, str(value)]
    return argv
