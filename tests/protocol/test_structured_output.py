"""Reading a request's output grammar (`prfaas/protocol/structured_output.py`) as vLLM 0.32
does: each source and shape, and each malformed one a 400 naming its parameter."""

from __future__ import annotations

from typing import Any

import pytest

from prfaas.protocol.errors import APIError
from prfaas.protocol.structured_output import StructuredOutput, structured_from_body

PERSON = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time"}},
]
EMPTY = {"type": "object", "properties": {}}


def _json_schema(schema: Any, **extra: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, **extra}}


def _refused(body: dict[str, Any]) -> APIError:
    with pytest.raises(APIError) as info:
        structured_from_body(body)
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"response_format": None},
        {"response_format": {"type": "text"}},
        {"structured_outputs": None},
        {"tools": TOOLS},
        {"tools": TOOLS, "tool_choice": "auto"},
        {"tools": TOOLS, "tool_choice": "none"},
        {"tool_choice": "none"},
    ],
)
def test_free_text(body: dict[str, Any]) -> None:
    assert structured_from_body(body) is None


def test_response_format_json_object_and_json_schema() -> None:
    assert structured_from_body({"response_format": {"type": "json_object"}}) == (
        StructuredOutput("json", None)
    )
    rf = _json_schema(PERSON, strict=True, description="a person")
    out = structured_from_body({"response_format": rf})
    assert out == StructuredOutput("json", PERSON) and out.param == "response_format"


@pytest.mark.parametrize(
    ("so", "expected", "key"),
    [
        ({"json": PERSON}, StructuredOutput("json", PERSON), "json"),
        ({"json": '{"type": "integer"}'}, StructuredOutput("json", {"type": "integer"}), "json"),
        ({"regex": "[a-z]+"}, StructuredOutput("regex", "[a-z]+"), "regex"),
        ({"choice": ["yes", "no"]}, StructuredOutput("choice", ("yes", "no")), "choice"),
        ({"grammar": 'start: "x"'}, StructuredOutput("grammar", 'start: "x"'), "grammar"),
        ({"json_object": True}, StructuredOutput("json", None), "json_object"),
        # vLLM's options at their defaults change nothing; a null constraint is absent.
        (
            {"regex": "a", "json": None, "disable_any_whitespace": False},
            StructuredOutput("regex", "a"),
            "regex",
        ),
    ],
)
def test_structured_outputs(so: dict[str, Any], expected: StructuredOutput, key: str) -> None:
    out = structured_from_body({"structured_outputs": so})
    assert out == expected
    assert out is not None and out.param == f"structured_outputs.{key}"


def test_tool_choice_required_is_vllms_array_schema() -> None:
    out = structured_from_body({"tools": TOOLS, "tool_choice": "required"})
    assert out is not None and out.kind == "json" and out.param == "tool_choice"
    assert out.spec == {
        "type": "array",
        "minItems": 1,
        "items": {
            "type": "object",
            "anyOf": [
                {
                    "properties": {
                        "name": {"type": "string", "enum": ["get_weather"]},
                        "parameters": WEATHER,
                    },
                    "required": ["name", "parameters"],
                },
                {
                    "properties": {
                        "name": {"type": "string", "enum": ["get_time"]},
                        "parameters": EMPTY,
                    },
                    "required": ["name", "parameters"],
                },
            ],
        },
    }


def test_tool_choice_required_single_call_and_hoisted_defs() -> None:
    unit = {"type": "string", "enum": ["C", "F"]}
    properties = {"u": {"$ref": "#/$defs/unit"}}
    params = {"type": "object", "properties": properties, "$defs": {"unit": unit}}
    tools = [{"type": "function", "function": {"name": "t", "parameters": params}}]
    body = {"tools": tools, "tool_choice": "required", "parallel_tool_calls": False}
    out = structured_from_body(body)
    assert out is not None
    assert out.spec["maxItems"] == 1 and out.spec["$defs"] == {"unit": unit}
    assert "$defs" not in out.spec["items"]["anyOf"][0]["properties"]["parameters"]
    assert "$defs" in params  # the request itself is left as it was


def test_named_tool_choice_is_its_parameters() -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert structured_from_body({"tools": TOOLS, "tool_choice": named}) == (
        StructuredOutput("json", WEATHER)
    )
    named = {"type": "function", "function": {"name": "get_time"}}
    assert structured_from_body({"tools": TOOLS, "tool_choice": named}) == (
        StructuredOutput("json", EMPTY)
    )


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"response_format": "json"}, "response_format"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": PERSON}}},
            "response_format.json_schema.name",
        ),
        ({"response_format": _json_schema(None)}, "response_format.json_schema.schema"),
        ({"response_format": _json_schema([1])}, "response_format.json_schema.schema"),
        (
            {"response_format": _json_schema(PERSON, strict="yes")},
            "response_format.json_schema.strict",
        ),
        ({"structured_outputs": "regex"}, "structured_outputs"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice"),
        (
            {"structured_outputs": {"regex": "a", "whitespace_pattern": " "}},
            "structured_outputs.whitespace_pattern",
        ),
        (
            {"structured_outputs": {"regex": "a", "disable_any_whitespace": True}},
            "structured_outputs.disable_any_whitespace",
        ),
        ({"structured_outputs": {"ebnf": "x"}}, "structured_outputs.ebnf"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
        ({"structured_outputs": {"json": "[1, 2]"}}, "structured_outputs.json"),
        ({"structured_outputs": {"json": 3}}, "structured_outputs.json"),
        ({"structured_outputs": {"regex": 5}}, "structured_outputs.regex"),
        ({"structured_outputs": {"grammar": ["start"]}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"structured_outputs": {"choice": ["a", 1]}}, "structured_outputs.choice"),
        ({"structured_outputs": {"json_object": False}}, "structured_outputs.json_object"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"tools": [], "tool_choice": "required"}, "tool_choice"),
        ({"tools": {"a": 1}, "tool_choice": "required"}, "tools"),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice.function"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": ""}}},
            "tool_choice.function.name",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "custom", "function": {"name": "get_time"}}},
            "tool_choice.type",
        ),
        (
            {
                "tools": [{"type": "function", "function": {"parameters": EMPTY}}],
                "tool_choice": "required",
            },
            "tools",
        ),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}],
                "tool_choice": "required",
            },
            "tools",
        ),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"$defs": 1}}}
                ],
                "tool_choice": "required",
            },
            "tools",
        ),
    ],
)
def test_malformed_is_a_400_naming_the_parameter(body: dict[str, Any], param: str) -> None:
    assert _refused(body).param == param


@pytest.mark.parametrize(
    ("body", "second"),
    [
        (
            {"response_format": {"type": "json_object"}, "tools": TOOLS, "tool_choice": "required"},
            "tool_choice",
        ),
        (
            {"response_format": _json_schema(PERSON), "structured_outputs": {"regex": "a"}},
            "structured_outputs",
        ),
        (
            {
                "structured_outputs": {"choice": ["a"]},
                "tools": TOOLS,
                "tool_choice": {"type": "function", "function": {"name": "get_time"}},
            },
            "tool_choice",
        ),
    ],
)
def test_two_constraints_are_refused_naming_the_second(body: dict[str, Any], second: str) -> None:
    error = _refused(body)
    assert error.param == second and "cannot be combined" in error.message


def test_text_format_combines_with_tools() -> None:
    body = {"response_format": {"type": "text"}, "tools": TOOLS, "tool_choice": "required"}
    out = structured_from_body(body)
    assert out is not None and out.param == "tool_choice"
