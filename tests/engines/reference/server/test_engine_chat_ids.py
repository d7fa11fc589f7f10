"""A chat gives the same token ids through the gateway (which tokenizes and sends ids to
the engine's `/generate`) and through the engine's own OpenAI route (which tokenizes
itself): both load the checkpoint's tokenizer with `load_tokenizer` and apply the one
chat-template rule. The checkpoint here has a real tokenizer.json and a Jinja template."""

from __future__ import annotations

from pathlib import Path

import aiohttp
from engine_harness import engine_server
from tokenizer_helpers import write_byte_level_tokenizer

from prfaas.common.tokenizer import ChatMessage, chat_ids, load_tokenizer
from prfaas.engines.reference.handoff.base import InProcessHub
from prfaas.engines.reference.model.runner import ModelRunner
from prfaas.gateway.api.app import GatewayApp
from prfaas.gateway.deployment import DeploymentConfig, GatewayConfig, InstanceConfig, ModelConfig

MESSAGES = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is a hybrid model?"},
]


async def _chat(session: aiohttp.ClientSession, url: str, model: str) -> dict[str, object]:
    body = {"model": model, "messages": MESSAGES, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        answer: dict[str, object] = await resp.json()
        return answer


async def test_a_chat_has_the_same_token_ids_by_either_route(
    tiny_runner: ModelRunner, tmp_path: Path
) -> None:
    tokenizer = load_tokenizer(write_byte_level_tokenizer(tmp_path))
    ids = chat_ids(tokenizer, [ChatMessage(m["role"], m["content"]) for m in MESSAGES])
    assert ids[0] == tokenizer.encode("<|im_start|>")[0] and max(ids) < 260
    async with engine_server(tiny_runner, InProcessHub(), tokenizer) as engine:
        config = DeploymentConfig(
            ModelConfig(name="qwen3-next-tiny", tokenizer=str(tmp_path), block_size=16),
            GatewayConfig(threshold=1e6),
            (InstanceConfig("pd-b0", "pd", "both", engine.url, None, 9001),),
        )
        app = GatewayApp(config)
        port = await app.start("127.0.0.1", 0)
        try:
            async with aiohttp.ClientSession() as session:
                direct = await _chat(session, engine.url, "qwen3-next-tiny")
                routed = await _chat(session, f"http://127.0.0.1:{port}", "qwen3-next-tiny")
                greedy = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
                generate_body = {"input_ids": ids, "sampling_params": greedy}
                async with session.post(f"{engine.url}/generate", json=generate_body) as resp:
                    by_ids = await resp.json()
        finally:
            await app.stop()
    usage_direct, usage_routed = direct["usage"], routed["usage"]
    assert isinstance(usage_direct, dict) and isinstance(usage_routed, dict)
    assert usage_direct["prompt_tokens"] == usage_routed["prompt_tokens"] == len(ids)

    def text(answer: dict[str, object]) -> str:
        choices = answer["choices"]
        assert isinstance(choices, list)
        return str(choices[0]["message"]["content"])

    # Greedy output of a random model is a fingerprint of the prompt ids.
    assert text(direct) == text(routed) == by_ids["text"] != ""
