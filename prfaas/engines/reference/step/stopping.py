"""When a request stops, in SGLang's `finish_reason` format."""

from __future__ import annotations

from collections.abc import Callable

from prfaas.engines.reference.step.request import Request

FinishReason = dict[str, object]


def stop_reason(
    req: Request, eos_token_id: int | None, detokenize: Callable[[list[int]], str]
) -> FinishReason | None:
    """`{"type": "stop", "matched": ...}` on EOS, a stop token, a completed grammar or a
    stop string;
    `{"type": "length", "length": n}` at `max_new_tokens`; None to continue."""
    params, last = req.params, req.output[-1]
    if not params.ignore_eos and last == eos_token_id:
        return {"type": "stop", "matched": last}
    if last in params.stop_token_ids:
        return {"type": "stop", "matched": last}
    if req.constraint is not None and req.constraint.done:
        return {"type": "stop", "matched": None}  # the grammar is complete
    if params.stop and len(req.output) >= params.min_new_tokens:  # as vLLM: not before
        text = detokenize(req.output)
        new = len(detokenize(req.output[:-1]))  # only the last token's text can complete one
        for stop in params.stop:
            if stop in text[max(new - len(stop) + 1, 0) :]:
                return {"type": "stop", "matched": stop}
    if len(req.output) >= params.max_new_tokens:
        return {"type": "length", "length": params.max_new_tokens}
    return None
