"""The client's request body as it arrived, for an engine's own server to answer: what a
gateway hands the engine's OpenAI completions or chat route, its Anthropic Messages route or
its OpenAI Responses route (the parsers in `prfaas.protocol` say which fields the gateway
read)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

Api = Literal["completions", "chat", "messages", "responses"]
"""OpenAI completions and chat completions, Anthropic Messages, OpenAI Responses."""
PATHS: dict[Api, str] = {
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
    "messages": "/v1/messages",
    "responses": "/v1/responses",
}
"""Each API's route on an engine's server."""
EVENT_STREAMS: frozenset[Api] = frozenset({"messages", "responses"})
"""APIs whose streams name every event (`event: TYPE` before its `data:`) and end without
`data: [DONE]`."""


UNINDEXED_KEYS = ("extra_key", "lora_path")
"""Fields that key an engine's prefix cache besides a prompt's tokens and that its KV events
do not publish with the blocks (SGLang's `extra_key`) or that the index does not read (an
adapter's blocks are never indexed): a request with one is credited no cached prefix."""


@dataclass(frozen=True, eq=False)
class ClientBody:
    """One client body, whole (never mutated: engine clients copy what they change)."""

    api: Api
    fields: Mapping[str, Any]

    @property
    def path(self) -> str:
        return PATHS[self.api]

    @property
    def stream(self) -> bool:
        return self.fields.get("stream") is True

    def cache_salt(self) -> str | None:
        """The request's `cache_salt` (vLLM's and SGLang's): the engine keys its prompt's
        blocks by it too, so the router looks the prompt up from `hashing.salt_root` of it.
        None where absent or empty (SGLang salts nothing with an empty one; vLLM refuses
        it) or not one string (`unindexed_key` names it then)."""
        salt = self.fields.get("cache_salt")
        return salt if isinstance(salt, str) and salt else None

    def unindexed_key(self) -> str | None:
        """The first of `UNINDEXED_KEYS` the request sets (not None or empty), or
        `cache_salt` where it is not one string (SGLang takes a list, a salt per prompt of
        a batch), or None."""
        for key in UNINDEXED_KEYS:
            if self.fields.get(key) not in (None, ""):
                return key
        if not isinstance(self.fields.get("cache_salt"), str | None):
            return "cache_salt"
        return None

    def one_engine(self) -> str | None:
        """Why this request must run whole on one engine (its decode computing the prompt
        too), or None when a prefill may compute it elsewhere: several sequences (`n`,
        `best_of`, beam search, a batch of prompts) would each fetch the one transfer, and
        prompt log-probabilities or an echo need the prompt computed where it is answered.
        """
        f = self.fields
        for key in ("n", "best_of"):
            value = f.get(key)
            if isinstance(value, int) and value > 1:
                return key
        prompt = f.get("prompt")
        if isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], (str, list)):
            return "prompt"
        for key in ("use_beam_search", "echo"):
            if f.get(key) is True:
                return key
        if f.get("prompt_logprobs") is not None:
            return "prompt_logprobs"
        return None
