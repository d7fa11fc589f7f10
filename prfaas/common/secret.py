"""The deployment secret: one random key shared by the gateway and its engines.

It never travels itself: each use gets its own key derived with HMAC-SHA256 (a label per
use), so a leaked derived key does not give away the others.

- `control_token()`: the bearer token the gateway sends to an engine's routes
  (`Authorization: Bearer <token>`; SGLang's `--api-key` checks the same header).
- `transport_key()`: the key of the KV transport's HELLO challenge-response
  (`engines/transport/PROTOCOL.md`).

Where it comes from: `PRFAAS_SECRET` (hex) in the environment, or a file holding the hex
(`PRFAAS_SECRET_FILE`, or a path given on the command line). `prfaas serve` generates one
for the engines it launches and hands it to them in their environment, never in their
command line (which `ps` shows to every user).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

ENV_SECRET = "PRFAAS_SECRET"
ENV_SECRET_FILE = "PRFAAS_SECRET_FILE"
MIN_BYTES = 16
_CONTROL = b"prfaas control v1"
_TRANSPORT = b"prfaas transport v1"


@dataclass(frozen=True, repr=False)
class DeploymentSecret:
    """The shared key (at least 16 bytes). `repr` never shows it."""

    key: bytes

    def __post_init__(self) -> None:
        if len(self.key) < MIN_BYTES:
            raise ValueError(
                f"the deployment secret must be >= {MIN_BYTES} bytes, got {len(self.key)}"
            )

    def __repr__(self) -> str:
        return "DeploymentSecret(<hidden>)"

    @classmethod
    def generate(cls) -> DeploymentSecret:
        """A fresh random secret (32 bytes from `secrets`)."""
        return cls(secrets.token_bytes(32))

    @classmethod
    def from_hex(cls, text: str, source: str = "secret") -> DeploymentSecret:
        """Parse hex text (surrounding whitespace ignored).

        Raises:
            ValueError: not hex, or too short (the message names `source`, not the value).
        """
        try:
            key = bytes.fromhex(text.strip())
        except ValueError:
            raise ValueError(f"{source}: the deployment secret must be hex digits") from None
        if len(key) < MIN_BYTES:
            raise ValueError(f"{source}: the deployment secret must be >= {MIN_BYTES} bytes")
        return cls(key)

    @classmethod
    def from_file(cls, path: str | Path) -> DeploymentSecret:
        """Read hex from `path`. Raises ValueError (unreadable or invalid)."""
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ValueError(f"cannot read the deployment secret file {path}: {exc}") from None
        return cls.from_hex(text, str(path))

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, path: str | Path | None = None
    ) -> DeploymentSecret | None:
        """The secret from `path`, else `PRFAAS_SECRET`, else `PRFAAS_SECRET_FILE`; None if
        none is set. Raises ValueError for a set but invalid one."""
        env = os.environ if environ is None else environ
        if path is not None:
            return cls.from_file(path)
        if env.get(ENV_SECRET):
            return cls.from_hex(env[ENV_SECRET], ENV_SECRET)
        if env.get(ENV_SECRET_FILE):
            return cls.from_file(env[ENV_SECRET_FILE])
        return None

    def hex(self) -> str:
        """The secret as hex (to hand to a child process's environment)."""
        return self.key.hex()

    def derive(self, label: bytes) -> bytes:
        """HMAC-SHA256(secret, label): a key for one use."""
        return hmac.new(self.key, label, hashlib.sha256).digest()

    def control_token(self) -> str:
        """The bearer token of engines' HTTP routes."""
        return self.derive(_CONTROL).hex()

    def transport_key(self) -> bytes:
        """The key of the KV transport's handshake."""
        return self.derive(_TRANSPORT)


def token_matches(header: str | None, token: str) -> bool:
    """Whether an `Authorization` header carries `Bearer <token>` (constant-time compare)."""
    if not header:
        return False
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(given.strip().encode(), token.encode())
