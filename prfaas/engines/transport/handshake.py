"""The connection handshake: HELLO, WELCOME, AUTH with an HMAC challenge-response.

Both sides hold the same key (the deployment secret's transport key; empty when the
deployment runs without one, which authenticates nothing). Each side draws a fresh 16-byte
nonce per connection, so a proof is bound to that connection and cannot be replayed on
another one; the sender proves itself first (the receiver never talks to an impostor), the
receiver second (the sender attaches nothing to a peer's slot before that). The proofs use
different labels, so a proof one side gives never passes as the other side's. Layout in
PROTOCOL.md ("Handshake").
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from typing import Any

from prfaas.engines.transport.errors import ProtocolError
from prfaas.engines.transport.frames import Frame, Header, Kind
from prfaas.engines.transport.wire import json_frame, parse_json, verify

NONCE_BYTES = 16
HANDSHAKE_MAX = 1024
"""Largest HELLO / WELCOME / AUTH payload (a handshake frame never needs more)."""
_SENDER = b"prfaas-kv S"
_RECEIVER = b"prfaas-kv R"


def new_nonce() -> str:
    """A fresh connection nonce (hex)."""
    return secrets.token_hex(NONCE_BYTES)


def _proof(key: bytes, label: bytes, first: str, second: str, peer: str, index: int) -> str:
    message = b"|".join([label, first.encode(), second.encode(), peer.encode(), b"%d" % index])
    return hmac.new(key, message, hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class Hello:
    """What a receiver's HELLO says: who it is, which slot, and its nonce."""

    peer: str
    index: int
    nonce: str

    def frame(self) -> Frame:
        return json_frame(Kind.HELLO, 0, {"peer": self.peer, "index": self.index,
                                          "nonce": self.nonce})  # fmt: skip

    def sender_proof(self, key: bytes, sender_nonce: str) -> str:
        """The sender's proof, carried in WELCOME."""
        return _proof(key, _SENDER, self.nonce, sender_nonce, self.peer, self.index)

    def receiver_proof(self, key: bytes, sender_nonce: str) -> str:
        """The receiver's proof, carried in AUTH."""
        return _proof(key, _RECEIVER, sender_nonce, self.nonce, self.peer, self.index)


def _payload(header: Header, payload: bytes, kind: Kind) -> dict[str, Any]:
    if header.kind is not kind:
        raise ProtocolError(f"expected {kind.name}, got {header.kind.name}")
    if header.length > HANDSHAKE_MAX or not verify(header, payload):
        raise ProtocolError(f"{kind.name} is oversized or fails its checksum")
    return parse_json(header, payload)


def _hex(body: dict[str, Any], key: str, chars: int) -> str:
    value = body.get(key)
    if not isinstance(value, str) or len(value) != chars:
        raise ProtocolError(f"{key!r} must be {chars} hex digits")
    try:
        bytes.fromhex(value)
    except ValueError:
        raise ProtocolError(f"{key!r} must be {chars} hex digits") from None
    return value


def parse_hello(header: Header, payload: bytes, connections: int) -> Hello:
    """A valid HELLO. Raises ProtocolError (wrong kind, bad fields, slot out of range)."""
    body = _payload(header, payload, Kind.HELLO)
    peer, index = body.get("peer"), body.get("index")
    if not isinstance(peer, str) or not 1 <= len(peer) <= 64:
        raise ProtocolError("HELLO 'peer' must be a string of 1..64 characters")
    if type(index) is not int or not 0 <= index < connections:
        raise ProtocolError(f"HELLO 'index' {index!r} is not in 0..{connections - 1}")
    return Hello(peer, index, _hex(body, "nonce", 2 * NONCE_BYTES))


def welcome_frame(hello: Hello, key: bytes, nonce: str, settings: dict[str, int]) -> Frame:
    """WELCOME: the sender's settings, its nonce and its proof."""
    proof = hello.sender_proof(key, nonce)
    return json_frame(Kind.WELCOME, 0, {**settings, "nonce": nonce, "proof": proof})


def check_welcome(hello: Hello, key: bytes, header: Header, payload: bytes) -> dict[str, Any]:
    """The sender's settings, once its proof checks out.

    Raises:
        ProtocolError: not a WELCOME, or a wrong proof (the sender holds another key).
    """
    body = _payload(header, payload, Kind.WELCOME)
    nonce = _hex(body, "nonce", 2 * NONCE_BYTES)
    if not hmac.compare_digest(_hex(body, "proof", 64), hello.sender_proof(key, nonce)):
        raise ProtocolError("the sender's WELCOME proof does not match (another deployment "
                            "secret?)")  # fmt: skip
    return body


def auth_frame(hello: Hello, key: bytes, sender_nonce: str) -> Frame:
    """AUTH: the receiver's proof."""
    return json_frame(Kind.AUTH, 0, {"proof": hello.receiver_proof(key, sender_nonce)})


def check_auth(hello: Hello, key: bytes, sender_nonce: str, header: Header, payload: bytes) -> None:
    """Raises ProtocolError unless the frame is an AUTH with the receiver's right proof."""
    body = _payload(header, payload, Kind.AUTH)
    if not hmac.compare_digest(_hex(body, "proof", 64), hello.receiver_proof(key, sender_nonce)):
        raise ProtocolError("AUTH proof does not match")
