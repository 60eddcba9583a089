"""argparse flags generated from a config dataclass: defaults, types, choices and help live on the
fields, once.

A field becomes `--field-name` (underscores to dashes) unless its metadata (`flag(...)`) names other
spellings; its help is the field's docstring (the string literal under it); `Literal[...]` gives
choices, `bool` a switch, `list[str]` a repeatable flag, `tuple[str, ...]` one or more values.
`config_from_args` builds the dataclass back (which validates it) from the parsed namespace.
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


def add_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type, *,
              skip: tuple[str, ...] = (), defaults: dict[str, Any] | None = None) -> None:
    """One flag per field of the dataclass `cls` (but `skip` and cli=False ones); `defaults` overrides
    a field's default for this parser (e.g. the port a role listens on)."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        spec = f.metadata.get("flag", {"names": (), "help": None, "cli": True, "kw": {}})
        if f.name in skip or not spec["cli"]:
            continue
        names = spec["names"] or (f"--{f.name.replace('_', '-')}",)
        kw: dict[str, Any] = {"dest": f.name, "help": spec["help"] or docs.get(f.name)}
        tp = _unoptional(hints[f.name])
        if defaults and f.name in defaults:
            default = defaults[f.name]
        elif f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
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


def config_from_args(cls: type, args: argparse.Namespace, **overrides: Any) -> Any:
    """The dataclass from the parsed flags (fields without a flag keep their defaults)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    values.update(overrides)
    return cls(**values)
