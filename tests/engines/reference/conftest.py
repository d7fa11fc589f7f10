"""Fixtures for the reference engine tests: one model cache per session, loaded tiny models."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from prfaas.engines.reference.model.presets import load_model, resolve
from prfaas.engines.reference.model.runner import ModelRunner

# One intra-op thread: the CI machine is shared, and OpenMP spinning on 2 busy cores makes
# each tiny op 10-100x slower. Engine subprocesses get `--threads 1` for the same reason.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def engine_model_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A per-session preset cache; also exported for engine subprocesses."""
    path = tmp_path_factory.mktemp("prfaas-models")
    old = os.environ.get("PRFAAS_MODEL_CACHE")
    os.environ["PRFAAS_MODEL_CACHE"] = str(path)
    yield path
    if old is None:
        os.environ.pop("PRFAAS_MODEL_CACHE", None)
    else:
        os.environ["PRFAAS_MODEL_CACHE"] = old


@pytest.fixture(scope="session")
def tiny_model(engine_model_cache: Path) -> PreTrainedModel:
    """The default preset (Qwen3-Next-style, 8 layers 3:1), float32, eval mode."""
    return load_model(resolve("qwen3-next-tiny", engine_model_cache))


@pytest.fixture(scope="session")
def tiny_runner(tiny_model: PreTrainedModel) -> ModelRunner:
    return ModelRunner(tiny_model)
