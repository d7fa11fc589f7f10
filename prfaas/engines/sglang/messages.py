"""The prfaas backend's control messages on SGLang's ZMQ sockets (both ends use these).

SGLang's bootstrap registry (`/route`) tells a decode rank only the prefill rank's ZMQ
address. Over that socket the decode sends `Register` once per prefill rank (its KV layout)
and `Metadata` once per request; the prefill answers `Register` with `Endpoint`: where its
transport listens (or why the layouts cannot exchange KV). The KV itself never touches
ZMQ: it streams over `prfaas.engines.transport`. Aborts use SGLang's own
`AbortNotification` frames.

Each message is two frames: a tag and a msgspec-JSON body.
"""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec


class _Message(msgspec.Struct, frozen=True):
    TAG: ClassVar[bytes]

    def to_zmq(self) -> list[bytes]:
        return [self.TAG, msgspec.json.encode(self)]


class Register(_Message, frozen=True):
    """Decode -> prefill rank, once per (prefill rank, decode rank): the decode's ZMQ address
    and its KV layout (`KVLayout.to_json()`)."""

    TAG: ClassVar[bytes] = b"PRFAAS_REGISTER"
    decode_ip: str
    decode_port: int
    layout: dict[str, Any]


class Endpoint(_Message, frozen=True):
    """Prefill rank -> decode, answering `Register`: the prefill rank's transport endpoint
    (keyed by its ZMQ address, which the decode got from `/route`), or an error."""

    TAG: ClassVar[bytes] = b"PRFAAS_ENDPOINT"
    rank_ip: str
    rank_port: int
    host: str
    port: int
    error: str = ""


class Metadata(_Message, frozen=True):
    """Decode -> prefill rank, once per request: the room is allocated on the decode side.
    Pages travel by logical index (`kv_pages.wire`), so no decode page ids are sent."""

    TAG: ClassVar[bytes] = b"PRFAAS_META"
    room: int
    decode_ip: str
    decode_port: int
    required_dst_info_num: int
    decode_prefix_len: int
    num_pages: int
    is_dummy: bool


MESSAGES: dict[bytes, type[_Message]] = {m.TAG: m for m in (Register, Endpoint, Metadata)}


def parse(frames: list[bytes]) -> Register | Endpoint | Metadata | None:
    """The message in `frames`, or None if they are not one of ours.

    Raises:
        msgspec.ValidationError, msgspec.DecodeError: one of ours, but malformed.
    """
    kind = MESSAGES.get(frames[0]) if len(frames) == 2 else None
    if kind is None:
        return None
    message: Register | Endpoint | Metadata = msgspec.json.decode(frames[1], type=kind)  # type: ignore[assignment]
    return message
