"""Application keys and the exception -> HTTP error mapping shared by the route modules."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from prfaas.engines.reference.handoff.base import HandoffError
from prfaas.engines.reference.server.errors import json_error
from prfaas.engines.reference.server.service import CapacityError, EngineService, Unavailable
from prfaas.engines.reference.server.streaming import HandoffFailed
from prfaas.engines.reference.server.tokenizers import EngineTokenizer
from prfaas.engines.reference.step.sampling import InvalidRequest


@dataclass(frozen=True)
class ModelInfo:
    """Static facts about the served model for `/server_info`."""

    model: str
    model_path: str
    architecture: str
    layer_types: tuple[str, ...]
    vocab_size: int
    tokenizer: str


SERVICE = web.AppKey("service", EngineService)
TOKENIZER = web.AppKey("tokenizer", EngineTokenizer)
INFO = web.AppKey("info", ModelInfo)


def error_for(exc: Exception) -> web.Response:
    """Map the engine's exceptions to JSON errors with the right status."""
    if isinstance(exc, CapacityError):
        return json_error(413, str(exc), code="context_length_exceeded")
    if isinstance(exc, InvalidRequest):
        return json_error(400, str(exc), code="invalid_request")
    if isinstance(exc, Unavailable):
        return json_error(503, str(exc), code="unavailable")
    if isinstance(exc, HandoffFailed):
        return json_error(exc.status, str(exc), code="kv_handoff_failed")
    if isinstance(exc, HandoffError):
        return json_error(502, f"KV hand-off failed: {exc}", code="kv_handoff_failed")
    raise exc
