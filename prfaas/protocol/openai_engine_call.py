"""What an engine's own OpenAI route reads: the gateway's parse (`parse_call`, whose routing
ids the engine computes too) plus everything the reference engine serves beyond
`/generate` sampling: several sequences (`n`), log-probabilities, tools and `tool_choice`,
structured output, and SGLang's disaggregation fields (`bootstrap_host`, `bootstrap_port`,
`bootstrap_room`, as sglang 0.5.23's `PDRoutingFields` carries them on its OpenAI requests)
with PrfaaS's `prefix_pull`, as on `/generate`.

Every field outside `ENGINE_FIELDS`, and every value of one the engine cannot honour
(`best_of` > 1, `echo`, stream options beyond usage), is refused with a 400 naming it:
never a silent drop.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

from prfaas.common.tokenizer import Tokenizer
from prfaas.protocol.errors import invalid
from prfaas.protocol.generate import (
    MAX_TOP_LOGPROBS,
    Bootstrap,
    SamplingParams,
    pd_bootstrap,
    pd_prefix_pull,
)
from prfaas.protocol.openai_request import (
    GATEWAY_FIELDS,
    GENERATE_FIELDS,
    HARMLESS_FIELDS,
    Api,
    CompletionCall,
    ModelLimits,
    parse_call,
    parse_sampling,
)
from prfaas.protocol.structured_output import StructuredOutput, structured_from_body

MAX_N = 16
"""The most sequences one request may ask for."""
ENGINE_FIELDS = GENERATE_FIELDS | HARMLESS_FIELDS | frozenset({
    "tools", "tool_choice", "parallel_tool_calls", "response_format", "structured_outputs",
    "add_generation_prompt", "continue_final_message", "chat_template_kwargs",
    "skip_special_tokens", "bootstrap_host", "bootstrap_port", "bootstrap_room", "prefix_pull",
    "reasoning_effort",
})  # fmt: skip
"""What the reference engine's OpenAI route serves."""
STREAM_OPTIONS = frozenset({"include_usage", "continuous_usage_stats"})
ToolMode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class EngineOpenAICall:
    """One OpenAI request as the engine runs it."""

    call: CompletionCall
    """Model, API, prompt ids, stream and usage options (the gateway's parse)."""
    sampling: SamplingParams
    """Every sampling field, log-probabilities included."""
    n: int = 1
    tool_mode: ToolMode = "none"
    """How output becomes tool calls: not at all, Hermes `<tool_call>` parsing (auto), the
    required array, or the named tool's arguments."""
    tool_name: str | None = None
    """The named tool (`tool_mode == "named"`)."""
    parallel_tool_calls: bool = True
    structured: StructuredOutput | None = None
    """The grammar the output follows (`response_format`, `structured_outputs`, or the
    schema `tool_choice` required or named implies)."""
    continuous_usage: bool = False
    """`stream_options.continuous_usage_stats`: usage in every streamed event."""
    bootstrap: Bootstrap | None = None
    prefix_pull: Bootstrap | None = None
    """PrfaaS's extension (engines that say `prefix_pull`): fetch the prompt's cached prefix
    from this room before computing the rest."""

    def sequence(self, index: int) -> SamplingParams:
        """Sequence `index`'s sampling: a seeded request's sequences draw apart."""
        seed = self.sampling.seed
        return self.sampling if seed is None or index == 0 else replace(
            self.sampling, seed=seed + index
        )  # fmt: skip


def parse_engine_call(
    body: dict[str, Any], api: Api, limits: ModelLimits, tokenizer: Tokenizer
) -> EngineOpenAICall:
    """Validate a request body for the engine's own OpenAI route.

    Raises:
        APIError: 400 naming the first field that is malformed or not served, 404 for a
            model that is not served.
    """
    for key in body:
        if key not in ENGINE_FIELDS:
            raise invalid(f"'{key}' is not supported by this engine", key)
    if api == "completions":
        for key in ("tools", "tool_choice", "parallel_tool_calls", "reasoning_effort"):
            if key in body:
                raise invalid(f"'{key}' is not supported by the completions API", key)
    if body.get("best_of") not in (None, 1):
        raise invalid("'best_of' > 1 is not supported by this engine", "best_of")
    if body.get("echo") not in (None, False):
        raise invalid("'echo' is not supported by this engine", "echo")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], (str, list)):
        raise invalid("a batch of prompts is not supported by this engine", "prompt")
    options = body.get("stream_options")
    if isinstance(options, dict) and set(options) - STREAM_OPTIONS:
        key = sorted(set(options) - STREAM_OPTIONS)[0]
        raise invalid(f"'stream_options.{key}' is not supported", f"stream_options.{key}")
    call = parse_call(body, api, limits, tokenizer, "forward", pd_fields=True)
    sampling = replace(parse_sampling(body), top_logprobs=_logprobs(body, api))
    vocab = limits.vocab_size
    if vocab is not None and any(t >= vocab for t, _ in sampling.logit_bias):
        raise invalid(f"'logit_bias' names a token id outside the vocabulary [0, {vocab})",
                      "logit_bias")  # fmt: skip
    if body.get("skip_special_tokens") is False:
        sampling = replace(sampling, skip_special_tokens=False)
    mode, name = _tool_mode(body)
    structured = structured_from_body(body)
    n = body.get("n")
    if n is not None and (type(n) is not int or not 1 <= n <= MAX_N):
        raise invalid(f"'n' must be an integer in [1, {MAX_N}], got {n!r}", "n")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise invalid("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    if (n or 1) > 1 and any(k in body for k in GATEWAY_FIELDS):
        raise invalid("'n' > 1 runs on one engine: not with bootstrap_* fields", "n")
    continuous = (
        call.include_usage
        and isinstance(options, dict)
        and (options.get("continuous_usage_stats") is True)
    )  # as vLLM: only with the usage itself
    pd = {k: body[k] for k in GATEWAY_FIELDS if k in body and k != "kv_transfer_params"}
    if "kv_transfer_params" in body:
        raise invalid("'kv_transfer_params' is vLLM's: this engine takes bootstrap_*",
                      "kv_transfer_params")  # fmt: skip
    return EngineOpenAICall(
        call, sampling, n or 1, mode, name, parallel is not False, structured,
        continuous, pd_bootstrap(pd), pd_prefix_pull(body),
    )  # fmt: skip


def _logprobs(body: dict[str, Any], api: Api) -> int | None:
    """How many alternatives each output token's log-probabilities list, or None for no
    log-probabilities (chat: `logprobs` true with `top_logprobs`; completions: `logprobs`
    as the count)."""
    value, top = body.get("logprobs"), body.get("top_logprobs")
    if api == "completions":
        if top is not None:
            raise invalid("'top_logprobs' is a chat field: completions take 'logprobs' as "
                          "the count", "top_logprobs")  # fmt: skip
        if value is None:
            return None
        if type(value) is not int or not 0 <= value <= MAX_TOP_LOGPROBS:
            raise invalid(f"'logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}]", "logprobs")
        return int(value)
    if value is not None and not isinstance(value, bool):
        raise invalid("'logprobs' must be a boolean", "logprobs")
    if top is not None:
        if type(top) is not int or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise invalid(f"'top_logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}]",
                          "top_logprobs")  # fmt: skip
        if not value:
            raise invalid("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (top or 0) if value else None


def _tool_mode(body: dict[str, Any]) -> tuple[ToolMode, str | None]:
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools or choice == "none":
        return "none", None
    if choice is None or choice == "auto":
        return "auto", None
    if choice == "required":
        return "required", None
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if isinstance(name, str):
            return "named", name
    raise invalid("'tool_choice' must be none, auto, required or a named function", "tool_choice")
