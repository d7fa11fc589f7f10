"""One attempt of a routed request: its prefill call and its decode call (one call when a
"both" instance does both), and the accounting of both instances. `router.Dispatch` runs
a request as one or more attempts (retries before output, migrations after).

The prefill call is watched, not read: if it fails before the decode produced anything,
the decode call is aborted with the prefill's error (the decode would only wait for KV that
never comes); once the decode has output, its KV arrived and was verified, so a late
prefill failure no longer matters. If the decode call fails, the prefill call is aborted.
When both fail, the prefill's error wins (and the prefill instance is the one to blame).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence

from prfaas.engine_clients.base import EngineCall, EngineError
from prfaas.gateway.instances import InstanceState
from prfaas.policies.routing import RouteDecision
from prfaas.protocol.generate import GenerateChunk, GenerateRequest


class Attempt:
    """The calls of one attempt, started when created."""

    def __init__(
        self,
        decision: RouteDecision,
        prefill: InstanceState,
        decode: InstanceState,
        request: GenerateRequest,
        prefill_request: GenerateRequest | None = None,
        *,
        on_prefill_over: Callable[[], None] | None = None,
    ) -> None:
        """`prefill_request`: what the prefill gets when it differs from `request` (a prefix
        pull). `on_prefill_over` runs once when the prefill is over (its call ended, the one
        instance that does both produced its first chunk, or the attempt closed)."""
        self.decision, self.request = decision, request
        self._on_prefill_over = on_prefill_over
        self.prefill, self.decode = prefill, decode
        self.failed: InstanceState | None = None
        """The instance blamed for the attempt's failure (set when it failed)."""
        self._output = self._closed = False
        prefill.in_flight += 1
        decode.in_flight += 1
        self._decode_call = decode.client.generate(request)
        decode.calls.add(self._decode_call)
        self._prefill_call: EngineCall | None = None
        if prefill is not decode:
            self._prefill_call = prefill.client.generate(prefill_request or request)
            prefill.calls.add(self._prefill_call)
            self._prefill_call.ended.add_done_callback(self._prefill_ended)

    def _prefill_over(self) -> None:
        callback, self._on_prefill_over = self._on_prefill_over, None
        if callback is not None:
            callback()

    def _prefill_ended(self, ended: asyncio.Future[None]) -> None:
        self._prefill_over()
        error = self._prefill_error()
        if error is not None and not self._output:
            self._decode_call.abort(error)

    def _prefill_error(self) -> EngineError | None:
        call = self._prefill_call
        if call is None or not call.ended.done():
            return None
        error = call.ended.exception()
        return error if isinstance(error, EngineError) else None

    async def next(self) -> GenerateChunk | None:
        """The next decode chunk; None at the end.

        Raises:
            EngineError: the attempt failed (`failed` names the instance to blame).
        """
        try:
            chunk = await self._decode_call.next()
        except EngineError as exc:
            prefill_error = self._prefill_error()
            if prefill_error is not None and (exc is prefill_error or not self._output):
                self.failed = self.prefill
                raise prefill_error from None
            self.failed = self.decode
            raise
        if chunk is not None:
            self._output = True
            if self._prefill_call is None:
                self._prefill_over()  # one instance does both: its first token ends the prefill
            return chunk
        prefill = self._prefill_call
        if prefill is not None and not prefill.ended.done():
            # shielded: a cancelled wait must not cancel it; its failure no longer matters
            with contextlib.suppress(EngineError):
                await asyncio.shield(prefill.ended)
        return None

    def abort_prefill(self, error: EngineError) -> None:
        """End the prefill call with `error` (the decode, still waiting, is aborted too)."""
        if self._prefill_call is not None:
            self._prefill_call.abort(error)

    def close(self) -> None:
        """Abort calls still running; drop the instances' in-flight counts. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._prefill_over()
        self._decode_call.abort()
        self.decode.calls.discard(self._decode_call)
        self.decode.in_flight -= 1
        if self._prefill_call is not None:
            self._prefill_call.abort()
            self.prefill.calls.discard(self._prefill_call)
        self.prefill.in_flight -= 1


class Continuation:
    """The text of a migrated request, rebuilt from all of its output ids.

    The new decode engine decodes only its own ids, so a character whose bytes straddle the
    migration point would come out as two replacement characters, and a multi-token merge
    could differ. Here the visible text is `decode(all output ids)`, holding back a trailing
    incomplete character until the end as the engines do, and cut by as much as the engine
    cut its own text (a matched stop string)."""

    def __init__(self, handed: str) -> None:
        self._handed = handed  # text handed out before and since the migration
        self._engine_text = ""  # the new engine's visible text so far
        self._engine_ids: list[int] = []

    def add(
        self,
        chunk: GenerateChunk,
        output: Sequence[int],
        detokenize: Callable[[Sequence[int]], str],
    ) -> str:
        """The text delta to hand out for `chunk` (`output`: every output id so far)."""
        self._engine_text += chunk.text
        self._engine_ids.extend(chunk.token_ids)
        final = chunk.finish_reason is not None
        cut = len(_stable(detokenize(self._engine_ids), final)) - len(self._engine_text)
        full = _stable(detokenize(output), final)
        visible = full[: len(full) - cut] if cut > 0 else full
        if not visible.startswith(self._handed):  # a tokenizer that re-merges: trust the engine
            visible = self._handed + chunk.text
        delta = visible[len(self._handed) :]
        self._handed = visible
        return delta


def _stable(text: str, final: bool) -> str:
    """As the engines do: a trailing replacement character (an incomplete UTF-8 sequence)
    waits for the end."""
    return text if final else text.rstrip("\ufffd")
