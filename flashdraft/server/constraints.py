"""A request's output constraint, in any of the spellings clients send (all to StructuredOutputsParams):
OpenAI's `response_format` ({"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema":
...}}, and xgrammar's {"type": "structural_tag", "format": ...}), vLLM's `structured_outputs` object, its
`structural_tag` and its older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`, and
SGLang's `json_schema` / `regex` / `ebnf`. More than one is a 400, as is a malformed one."""

from __future__ import annotations

import json
from typing import Any

from flashdraft.sampling_params import StructuredOutputsParams

# (request field, StructuredOutputsParams field) for the flat spellings
FLAT = (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"), ("guided_grammar", "grammar"),
        ("structural_tag", "structural_tag"), ("json_schema", "json"), ("regex", "regex"), ("ebnf", "grammar"))
FIELDS = {"structured_outputs", "response_format"} | {name for name, _ in FLAT}


class ConstraintError(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def constraint(fields: dict[str, Any]) -> StructuredOutputsParams | None:
    """The constraint among a request's fields (None: none given); ConstraintError naming the field."""
    found: list[tuple[str, dict]] = []
    rf = fields.get("response_format")
    if rf is not None:
        found += [("response_format", kw)] if (kw := _response_format(rf)) else []
    so = fields.get("structured_outputs")
    if so is not None and so != {}:
        if not isinstance(so, dict):
            raise ConstraintError("structured_outputs must be an object", "structured_outputs")
        known = {"json", "json_object", "regex", "choice", "grammar", "structural_tag"}
        unknown = sorted(set(so) - known - {"disable_fallback", "disable_any_whitespace",
                                            "disable_additional_properties", "whitespace_pattern"})
        if unknown:
            raise ConstraintError(f"structured_outputs.{unknown[0]} is not supported", "structured_outputs")
        found.append(("structured_outputs", {k: v for k, v in so.items() if k in known and v is not None}))
    for name, key in FLAT:
        value = fields.get(name)
        if value is not None and value != [] and value != {}:
            found.append((name, {key: _schema(value, name) if key == "json" and _is_json_text(value) else value}))
    if not found:
        return None
    if len(found) > 1:
        raise ConstraintError(f"give one output constraint, got {' and '.join(n for n, _ in found)}", found[1][0])
    name, kw = found[0]
    try:
        return StructuredOutputsParams(**kw)
    except (TypeError, ValueError) as e:
        raise ConstraintError(f"{name}: {e}", name) from None


def constraint_field(fields: dict[str, Any]) -> str:
    """The name of the field a request's constraint came in (for a 400 about it)."""
    return next((n for n in ("response_format", "structured_outputs", *(n for n, _ in FLAT))
                 if fields.get(n) not in (None, [], {})), "structured_outputs")


def _response_format(rf: Any) -> dict | None:
    if not isinstance(rf, dict) or "type" not in rf:
        raise ConstraintError("response_format must be an object with a type", "response_format")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "structural_tag":  # (xgrammar's own form: {"type": "structural_tag", "format": ...})
        return {"structural_tag": rf}
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise ConstraintError("response_format.json_schema must be an object with a schema", "response_format")
        return {"json": spec.get("schema") or {"type": "object"}}  # (no schema given: any JSON object)
    raise ConstraintError(f"response_format type {kind!r} is not supported (text, json_object, json_schema, "
                          "structural_tag)",
                          "response_format")


def _schema(text: str, name: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ConstraintError(f"{name} is not a JSON schema: {e}", name) from None


def _is_json_text(value: Any) -> bool:
    return isinstance(value, str) and value.lstrip().startswith("{")
