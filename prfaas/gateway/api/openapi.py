"""`GET /openapi.json`: an OpenAPI 3.1 description of what the gateway serves, made from its
route table (every path and method it answers, nothing it does not), with each route's
purpose, body and answers. The request bodies are the APIs' own (OpenAI's and Anthropic's
references describe their fields); the gateway's own bodies (`/admin/state`) and errors are
described here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import prfaas

RouteInfo = tuple[str, bool, bool]
"""(summary, takes a JSON body, may answer with an event stream)."""
ROUTE_INFO: dict[str, RouteInfo] = {
    "/v1/completions": ("OpenAI completions, routed by the prompt's uncached length", True, True),
    "/v1/chat/completions": ("OpenAI chat completions, routed likewise", True, True),
    "/v1/messages": ("Anthropic Messages, routed likewise (Anthropic's error bodies)", True, True),
    "/v1/messages/count_tokens": ("Anthropic's prompt token count", True, False),
    "/v1/responses": (
        "OpenAI Responses; `store` and `previous_response_id` kept by the gateway",
        True,
        True,
    ),
    "/v1/responses/{response_id}": (
        "A stored response (GET; `stream=true`: a streamed background response's events "
        "again, those after `starting_after`) or its deletion (DELETE)",
        False,
        False,
    ),
    "/v1/responses/{response_id}/cancel": ("Cancel a background response", False, False),
    "/v1/models": ("The served model", False, False),
    "/tokenize": ("A prompt or chat's token ids (vLLM's body)", True, False),
    "/detokenize": ("Token ids' text (vLLM's body)", True, False),
    "/version": ("The engines' (vLLM) or the gateway's version", False, False),
    "/ping": ("Readiness: 200 while a decode instance is healthy, else 503", False, False),
    "/health": ("Health of the deployment (503 without a healthy decode)", False, False),
    "/metrics": ("Prometheus exposition", False, False),
    "/openapi.json": ("This document", False, False),
    "/admin/state": (
        "Clusters, threshold, regime, egress (POST: set them, or roles by hand; operator key)",
        True,
        False,
    ),
    "/admin/dashboard": ("What the live dashboard polls (operator key when set)", False, False),
}
"""Every route's description (pages of the dashboard aside, which are described together)."""
PAGE = ("The live dashboard and its files", False, False)
ERROR = {
    "type": "object",
    "description": "OpenAI's error body; Anthropic's ({type: error, error: {type, message}}) "
    "under /v1/messages",
    "properties": {"error": {"type": "object", "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]},
    }}},
}  # fmt: skip


def document(paths: Mapping[str, Iterable[str]], model: str) -> dict[str, Any]:
    """The OpenAPI document of `paths` (each path's methods; `{response_id}` in templated
    ones)."""
    described: dict[str, Any] = {}
    for path, methods in paths.items():
        summary, body, stream = ROUTE_INFO.get(path, PAGE)
        described[path] = {m.lower(): _operation(path, m, summary, body, stream)
                           for m in methods}  # fmt: skip
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "PrfaaS gateway",
            "version": prfaas.__version__,
            "description": f"Serves the model {model!r}.",
        },
        "paths": described,
        "components": {"schemas": {"Error": ERROR}},
    }


def _operation(path: str, method: str, summary: str, body: bool, stream: bool) -> dict[str, Any]:
    media: dict[str, Any] = {"application/json": {"schema": {"type": "object"}}}
    if stream:
        media["text/event-stream"] = {"schema": {"type": "string"}}
    schema = {"$ref": "#/components/schemas/Error"}
    error = {"description": "An error", "content": {"application/json": {"schema": schema}}}
    operation: dict[str, Any] = {
        "summary": summary,
        "responses": {"200": {"description": "OK", "content": media}, "default": error},
    }
    if "{response_id}" in path:
        operation["parameters"] = [{"name": "response_id", "in": "path", "required": True,
                                    "schema": {"type": "string"}}]  # fmt: skip
    if path == "/v1/responses/{response_id}" and method == "GET":
        media["text/event-stream"] = {"schema": {"type": "string"}}
        operation["parameters"] += [
            {"name": "stream", "in": "query", "schema": {"type": "boolean"}},
            {"name": "starting_after", "in": "query", "schema": {"type": "integer", "minimum": 0}},
        ]
    if body and method == "POST":
        operation["requestBody"] = {
            "required": True, "content": {"application/json": {"schema": {"type": "object"}}},
        }  # fmt: skip
    return operation
