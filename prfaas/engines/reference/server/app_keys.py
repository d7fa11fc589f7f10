"""Application keys of the engine's aiohttp app, and the static facts it serves."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from prfaas.common.tokenizer import Tokenizer
from prfaas.engines.reference.server.service import EngineService


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
TOKENIZER = web.AppKey("tokenizer", Tokenizer)
INFO = web.AppKey("info", ModelInfo)
