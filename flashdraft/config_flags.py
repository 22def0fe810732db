"""Command-line flags made from dataclass fields: a field declared with `flag(...)` carries its help
text and parse rules in its metadata, and `add_flags` / `flag_kwargs` walk the fields, so an option is
written once (EngineConfig in config.py is the one user)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable, Iterable
from typing import Any

_KEY = "flag"  # the metadata key; its value is a FlagSpec, or None for a field that is no flag


@dataclasses.dataclass(frozen=True)
class FlagSpec:
    help: str
    type: Callable[[str], Any] | None = None  # None: from the annotation (int, float or str)
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    names: tuple[str, ...] | None = None  # option strings; None: --field-name; (): none of its own
    dest: str | None = None  # None: the field's name
    off: dict[str, str] = dataclasses.field(default_factory=dict)  # store_true flags setting the field off
    opt_in: bool = False  # added only when the parser asks for it by name


def flag(default: Any, help: str = "", *, type: Callable[[str], Any] | None = None,
         choices: Iterable[str] | None = None, metavar: str | None = None, names: tuple[str, ...] | None = None,
         dest: str | None = None, off: dict[str, str] | None = None, opt_in: bool = False) -> Any:
    """A dataclass field that is also a flag. A bool field defaulting to False is a store_true flag, one
    defaulting to None a --x / --no-x pair. off: store_true flags (name: help) any of which sets the field
    to its off value, `not default` for a bool, else None (--no-spec: no drafter)."""
    spec = FlagSpec(help, type, tuple(choices) if choices is not None else None, metavar, names, dest,
                    dict(off or {}), opt_in)
    return dataclasses.field(default=default, metadata={_KEY: spec})


def no_flag(default: Any) -> Any:
    """A dataclass field set from Python (LLM(**kwargs)) only, on purpose not a flag."""
    return dataclasses.field(default=default, metadata={_KEY: None})


def flag_spec(f: dataclasses.Field) -> FlagSpec | None:
    if _KEY not in f.metadata:  # so a new field cannot be forgotten by the CLI
        raise TypeError(f"field {f.name} is declared with neither flag(...) nor no_flag(...)")
    return f.metadata[_KEY]


def add_flags(p: argparse.ArgumentParser, cls: type, opt_in: Iterable[str] = ()) -> None:
    """One argparse option (and its off flags) per flag field of the dataclass `cls`, in field order;
    opt_in: the names of the opt-in fields to add."""
    wanted = set(opt_in)
    for f in dataclasses.fields(cls):
        spec = flag_spec(f)
        if spec is None or (spec.opt_in and f.name not in wanted):
            continue
        names = spec.names if spec.names is not None else ("--" + f.name.replace("_", "-"),)
        if names:
            if not spec.help:
                raise TypeError(f"flag field {f.name} has no help text")
            kw: dict[str, Any] = dict(default=f.default, help=spec.help, dest=spec.dest or f.name)
            if spec.metavar is not None:
                kw["metavar"] = spec.metavar
            if spec.choices is not None:
                kw["choices"] = list(spec.choices)
            if _base_type(f) == "bool":
                if f.default not in (False, None):
                    raise TypeError(f"bool field {f.name} defaults to {f.default!r}: give it off flags instead")
                kw["action"] = "store_true" if f.default is False else argparse.BooleanOptionalAction
            else:
                kw["type"] = spec.type or _annotated_type(f)
            p.add_argument(*names, **kw)
        for name, text in spec.off.items():
            p.add_argument(name, action="store_true", help=text)


def flag_kwargs(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The dataclass's keyword arguments that the flags `add_flags` made hold in `args`; an opt-in field
    the parser did not add is left out (its default stands)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        spec = flag_spec(f)
        if spec is None:
            continue
        dest = spec.dest or f.name
        if spec.opt_in and not hasattr(args, dest):
            continue
        value = getattr(args, dest) if spec.names != () else f.default
        if any(getattr(args, _dest(name)) for name in spec.off):
            value = (not f.default) if isinstance(f.default, bool) else None
        out[f.name] = value
    return out


def _dest(option: str) -> str:
    return option.lstrip("-").replace("-", "_")


def _base_type(f: dataclasses.Field) -> str:
    """The annotation without its `| None` (annotations are strings under `from __future__ import annotations`)."""
    parts = [s.strip() for s in str(f.type).split("|") if s.strip() != "None"]
    return parts[0] if len(parts) == 1 else str(f.type)


def _annotated_type(f: dataclasses.Field) -> Callable[[str], Any] | None:
    types = {"int": int, "float": float, "str": None}
    if _base_type(f) not in types:
        raise TypeError(f"field {f.name} ({f.type}) needs flag(type=...): its annotation names no one parser")
    return types[_base_type(f)]


# ---- parsers of the flags whose values are not one plain type -----------------------------------
def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object {{...}}, got {text!r}")
    return value


def tree_size(text: str) -> int | str | None:
    if text == "auto":
        return text
    if text in ("0", "off", "none"):
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of drafts, auto or off, got {text!r}") from None


def min_tau(text: str) -> float | str | None:
    if text == "auto":
        return text
    if text in ("0", "off", "none"):
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto, off or a number >= 1, got {text!r}") from None
    if not 1.0 <= value <= 1e6:
        raise argparse.ArgumentTypeError(f"expected auto, off or a number >= 1, got {text!r}")
    return value
