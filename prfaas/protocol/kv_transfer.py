"""vLLM's disaggregation protocol as PrfaaS speaks it: the `kv_transfer_params` object of an
OpenAI request, read by our vLLM connector (`prfaas.engines.vllm`) and written by the
gateway's vLLM client. The whole exchange is in `prfaas/engines/vllm/PROTOCOL.md`.

- To the prefill instance: `{"do_remote_decode": true, "room": R}`; it computes the prompt
  up to a handoff point C < N that both sides derive from N (vLLM's last Mamba checkpoint
  before the last token, or N-1) and streams its KV and the linear states at C to whichever
  decode registers room R at its KV sender.
- To the decode instance: `{"do_remote_prefill": true, "remote_host": H, "remote_port": P,
  "room": R}`; it loads C tokens of KV and the linear states from the prefill's KV sender
  at H:P into its own blocks, then computes the rest.
- A prefix pull (bandwidth-abundant regime), to the computing instance, alone or beside
  `do_remote_decode`: `{"prefix_pull": {"host": H, "port": P, "room": R, "tokens": S}}`; it
  loads the KV of the prompt's first S tokens and the linear states at S from the KV sender
  at H:P (room R, which the source's export request fills: `{"do_remote_decode": true,
  "room": R}` on the prompt's first S + 1 tokens), then computes the rest.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MAX_ROOM = 2**64 - 1


@dataclass(frozen=True)
class RemoteDecode:
    """The prefill side's parameters: stream the KV of room `room` to its decode."""

    room: int

    def __post_init__(self) -> None:
        _check_room(self.room)

    def to_json(self) -> dict[str, Any]:
        return {"do_remote_decode": True, "room": self.room}


@dataclass(frozen=True)
class RemotePrefill:
    """The decode side's parameters: fetch room `room` from the KV sender at host:port."""

    host: str
    port: int
    room: int

    def __post_init__(self) -> None:
        _check_room(self.room)
        if not self.host:
            raise ValueError("remote_host must not be empty")
        if not 0 < self.port < 65536:
            raise ValueError(f"remote_port must be a port, got {self.port!r}")

    def to_json(self) -> dict[str, Any]:
        return {
            "do_remote_prefill": True,
            "remote_host": self.host,
            "remote_port": self.port,
            "room": self.room,
        }


@dataclass(frozen=True)
class PrefixPull:
    """Load the prompt's first `tokens` tokens (KV and linear states) from room `room` at
    the KV sender host:port, which the source's export fills, before computing the rest."""

    host: str
    port: int
    room: int
    tokens: int

    def __post_init__(self) -> None:
        RemotePrefill(self.host, self.port, self.room)  # the same checks
        if self.tokens <= 0:
            raise ValueError(f"prefix_pull.tokens must be > 0, got {self.tokens!r}")

    def to_json(self) -> dict[str, Any]:
        return {"prefix_pull": {"host": self.host, "port": self.port, "room": self.room,
                                "tokens": self.tokens}}  # fmt: skip


def parse_prefix_pull(params: Mapping[str, Any] | None) -> PrefixPull | None:
    """The prefix pull a request's `kv_transfer_params` asks for (None: none).

    Raises:
        ValueError: `prefix_pull` is not `{"host", "port", "room", "tokens"}` as above.
    """
    pull = (params or {}).get("prefix_pull")
    if pull is None:
        return None
    if not isinstance(pull, Mapping):
        raise ValueError('prefix_pull must be {"host", "port", "room", "tokens"}')
    try:
        return PrefixPull(str(pull["host"]), _int(pull["port"]), _int(pull["room"]),
                          _int(pull["tokens"]))  # fmt: skip
    except KeyError as exc:
        raise ValueError(f"prefix_pull lacks {exc.args[0]!r}") from None


def parse_kv_transfer_params(
    params: Mapping[str, Any] | None,
) -> RemoteDecode | RemotePrefill | None:
    """The PrfaaS side a request's `kv_transfer_params` asks for (None: not disaggregated).

    Raises:
        ValueError: the params name a side but a field is missing or invalid.
    """
    if not params:
        return None
    try:
        if params.get("do_remote_prefill"):
            port = params["remote_port"]
            return RemotePrefill(str(params["remote_host"]), _int(port), _int(params["room"]))
        if params.get("do_remote_decode"):
            return RemoteDecode(_int(params["room"]))
    except KeyError as exc:
        raise ValueError(f"kv_transfer_params lacks {exc.args[0]!r}") from None
    return None


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"expected an integer, got {value!r}")
    return value


def _check_room(room: int) -> None:
    if not 0 <= room <= MAX_ROOM:
        raise ValueError(f"room must be in 0..2**64-1, got {room!r}")
