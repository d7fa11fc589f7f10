"""The grammar an OpenAI request asks its output to follow, read as vLLM 0.32's OpenAI server
reads it, so a request means the same on the reference engine as on a vLLM engine.

Three sources, at most one per request (a second is a 400 naming it):
- `response_format`: `text` (none), `json_object` (any JSON object) or `json_schema`.
- `structured_outputs` (vLLM's extension): one of `json` (a schema, or its JSON text),
  `regex`, `choice` (a list of strings), `grammar` (Lark, or GBNF as llguidance converts it),
  or `json_object: true`.
- `tool_choice` with `tools` (chat): `required` asks for vLLM's JSON array of
  `{"name", "parameters"}` calls, a named function for that function's arguments.

This module only reads and checks the request (no grammar library): compiling the grammar
for a vocabulary is the engine's job (`prfaas.engines.reference.step.constraint`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from prfaas.protocol.errors import invalid

Kind = Literal["json", "regex", "choice", "grammar"]


@dataclass(frozen=True)
class StructuredOutput:
    """A grammar over a request's output.

    `spec` by `kind`: json, a JSON-schema dict or None for any JSON object; regex, the
    pattern; choice, a tuple of the allowed strings; grammar, the grammar text (Lark).
    """

    kind: Kind
    spec: Any
    param: str = field(default="response_format", compare=False)
    """The request parameter it came from: what a 400 for an uncompilable grammar names."""


_CONSTRAINT_KEYS = ("json", "regex", "choice", "grammar", "json_object")
# vLLM's options of `structured_outputs`, accepted only at their defaults (no effect).
_OPTION_DEFAULTS: dict[str, object] = {
    "disable_any_whitespace": False,
    "disable_additional_properties": False,
    "whitespace_pattern": None,
    "structural_tag": None,
}
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def structured_from_body(body: Mapping[str, Any]) -> StructuredOutput | None:
    """The grammar a completions or chat body asks for, or None for free text.

    Raises:
        APIError: 400 naming the malformed field, the unsupported option, or the second of
            two constraint sources.
    """
    chosen: StructuredOutput | None = None
    first = ""
    for name, read in (
        ("response_format", _response_format),
        ("structured_outputs", _structured_outputs),
        ("tool_choice", _tool_choice),
    ):
        found = read(body)
        if found is None:
            continue
        if chosen is not None:
            raise invalid(f"'{name}' cannot be combined with '{first}': a request takes one "
                          "output constraint", name)  # fmt: skip
        chosen, first = found, name
    return chosen


def _response_format(body: Mapping[str, Any]) -> StructuredOutput | None:
    value = body.get("response_format")
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise invalid("'response_format' must be an object", "response_format")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json", None, "response_format")
    if kind != "json_schema":
        raise invalid("'response_format.type' must be 'text', 'json_object' or 'json_schema', "
                      f"got {kind!r}", "response_format")  # fmt: skip
    where = "response_format.json_schema"
    spec = value.get("json_schema")
    if not isinstance(spec, Mapping):
        raise invalid(f"'{where}' must be an object when the type is 'json_schema'", where)
    if not isinstance(spec.get("name"), str):
        raise invalid(f"'{where}.name' must be a string", f"{where}.name")
    if spec.get("description") is not None and not isinstance(spec["description"], str):
        raise invalid(f"'{where}.description' must be a string", f"{where}.description")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise invalid(f"'{where}.strict' must be a boolean", f"{where}.strict")
    schema = spec.get("schema")
    if not isinstance(schema, Mapping):
        raise invalid(f"'{where}.schema' must be a JSON-schema object", f"{where}.schema")
    return StructuredOutput("json", dict(schema), "response_format")


def _structured_outputs(body: Mapping[str, Any]) -> StructuredOutput | None:
    value = body.get("structured_outputs")
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise invalid("'structured_outputs' must be an object", "structured_outputs")
    for key, item in value.items():
        at_default = key in _OPTION_DEFAULTS and (item is None or item is _OPTION_DEFAULTS[key])
        if key in _CONSTRAINT_KEYS or at_default:
            continue
        raise invalid(f"'structured_outputs.{key}' is not supported by this engine",
                      f"structured_outputs.{key}")  # fmt: skip
    given = [k for k in _CONSTRAINT_KEYS if value.get(k) is not None]
    if not given:
        raise invalid("'structured_outputs' needs one of 'json', 'regex', 'choice', 'grammar' "
                      "or 'json_object'", "structured_outputs")  # fmt: skip
    if len(given) > 1:
        raise invalid(f"'structured_outputs' takes one constraint, got {', '.join(given)}",
                      f"structured_outputs.{given[1]}")  # fmt: skip
    key = given[0]
    return StructuredOutput(*_constraint(key, value[key]), f"structured_outputs.{key}")


def _constraint(key: str, value: Any) -> tuple[Kind, Any]:
    """One `structured_outputs` constraint as (kind, spec)."""
    param = f"structured_outputs.{key}"
    if key == "json":
        schema = value
        if isinstance(value, str):
            try:
                schema = json.loads(value)
            except ValueError:
                raise invalid(f"'{param}' is not valid JSON", param) from None
        if not isinstance(schema, Mapping):
            raise invalid(f"'{param}' must be a JSON-schema object or its JSON text", param)
        return "json", dict(schema)
    if key == "json_object":
        if value is not True:
            raise invalid(f"'{param}' must be true", param)
        return "json", None
    if key == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) for c in value)):
            raise invalid(f"'{param}' must be a non-empty list of strings", param)
        return "choice", tuple(value)
    if not isinstance(value, str):
        raise invalid(f"'{param}' must be a string", param)
    return ("regex" if key == "regex" else "grammar"), value


def _tool_choice(body: Mapping[str, Any]) -> StructuredOutput | None:
    choice, tools = body.get("tool_choice"), body.get("tools")
    if choice is None or choice == "none":
        return None
    if tools is None:
        raise invalid("'tool_choice' needs 'tools'", "tool_choice")
    if not isinstance(tools, list):
        raise invalid("'tools' must be a list of objects", "tools")
    if choice == "auto":
        return None
    if choice == "required":
        functions = [_function(t, i) for i, t in enumerate(tools)]
        if not functions:
            raise invalid("'tool_choice' required needs at least one tool", "tool_choice")
        schema = _required_schema(functions, body.get("parallel_tool_calls") is False)
        return StructuredOutput("json", schema, "tool_choice")
    if not isinstance(choice, Mapping):
        raise invalid("'tool_choice' must be 'none', 'auto', 'required' or "
                      '{"type": "function", "function": {"name": ...}}', "tool_choice")  # fmt: skip
    if choice.get("type", "function") != "function":
        raise invalid("'tool_choice.type' must be 'function'", "tool_choice.type")
    function = choice.get("function")
    if not isinstance(function, Mapping):
        raise invalid("'tool_choice.function' must be an object", "tool_choice.function")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise invalid("'tool_choice.function.name' must be a non-empty string",
                      "tool_choice.function.name")  # fmt: skip
    for tool_name, parameters in (_function(t, i) for i, t in enumerate(tools)):
        if tool_name == name:
            return StructuredOutput("json", dict(parameters or _EMPTY_PARAMETERS), "tool_choice")
    raise invalid(f"'tool_choice' names '{name}', which is not one of the 'tools'", "tool_choice")


def _function(tool: Any, i: int) -> tuple[str, dict[str, Any] | None]:
    """A tool's function name and parameters schema (None when absent)."""
    function = tool.get("function") if isinstance(tool, Mapping) else None
    if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
        raise invalid(f"'tools[{i}]' must be an object of type 'function'", "tools")
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise invalid(f"'tools[{i}].function' must be an object with a string 'name'", "tools")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, Mapping):
        raise invalid(f"'tools[{i}].function.parameters' must be an object", "tools")
    return function["name"], None if parameters is None else dict(parameters)


def _required_schema(
    functions: list[tuple[str, dict[str, Any] | None]], single: bool
) -> dict[str, Any]:
    """vLLM's schema for `tool_choice: "required"`: a non-empty array of calls, each one
    tool's name and parameters; at most one call when `parallel_tool_calls` is false. Each
    tool's `$defs` move to the top, where their `#/$defs/...` references resolve."""
    defs: dict[str, Any] = {}
    options = []
    for name, parameters in functions:
        params = dict(parameters or _EMPTY_PARAMETERS)
        own = params.pop("$defs", {})
        if not isinstance(own, Mapping):
            raise invalid(f"'$defs' in the parameters of tool '{name}' must be an object", "tools")
        for key, definition in own.items():
            if defs.setdefault(key, definition) != definition:
                raise invalid(f"tool definition '{key}' has several schemas", "tools")
        options.append({
            "properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
            "required": ["name", "parameters"],
        })  # fmt: skip
    schema: dict[str, Any] = {
        "type": "array", "minItems": 1, "items": {"type": "object", "anyOf": options},
    }  # fmt: skip
    if single:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema
