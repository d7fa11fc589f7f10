"""Optional TLS of the KV transport's connections (links that leave the datacenter).

One `TlsConfig` serves both ends of an engine: its bootstrap listener presents `cert_file`
and, with `verify_client`, requires a client certificate signed by `ca_file` (mutual TLS);
its fetches verify the sender's certificate against `ca_file` (or the system's trust store)
and present `cert_file` when a sender asks for one. The HMAC handshake still runs inside
TLS (PROTOCOL.md "TLS"). Only TLS 1.3: both ends are this package.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path


def _readable(what: str, path: Path) -> None:
    """Raise ValueError naming `path` unless it is a file this process can read."""
    try:
        with path.open("rb"):
            pass
    except OSError as exc:
        raise ValueError(f"transport TLS {what} {str(path)!r} cannot be read: "
                         f"{exc.strerror or exc}") from None  # fmt: skip


@dataclass(frozen=True)
class TlsConfig:
    """Certificates of one engine's transport TLS; every named file must be readable."""

    cert_file: Path | None = None
    """This end's certificate chain (PEM): served by the sender (required there); sent by
    the receiver when the sender asks for a client certificate."""
    key_file: Path | None = None
    """Private key (PEM, unencrypted) of `cert_file`."""
    ca_file: Path | None = None
    """CA certificates (PEM) this end trusts: the receiver verifies the sender's certificate
    against them (None: the system's default trust store); with `verify_client` the sender
    verifies receivers' certificates against them."""
    verify_client: bool = False
    """Sender: require a client certificate signed by `ca_file` (mutual TLS)."""
    server_name: str | None = None
    """Receiver: the name the sender's certificate must carry (None: the bootstrap host, so
    a certificate for an IP address needs that address in its subjectAltName)."""

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("transport TLS cert_file and key_file go together, got "
                             f"cert_file={self.cert_file}, key_file={self.key_file}")  # fmt: skip
        if self.verify_client and self.ca_file is None:
            raise ValueError("transport TLS verify_client needs a ca_file to verify against")
        if self.server_name is not None and not self.server_name:
            raise ValueError("transport TLS server_name must not be empty")
        for what, path in (("certificate", self.cert_file), ("key", self.key_file),
                           ("CA file", self.ca_file)):  # fmt: skip
            if path is not None:
                _readable(what, path)

    def server_context(self) -> ssl.SSLContext:
        """The bootstrap listener's context.

        Raises:
            ValueError: no certificate, or a file that does not load (naming it).
        """
        if self.cert_file is None or self.key_file is None:
            raise ValueError("a transport TLS sender needs cert_file and key_file")
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        self._load_chain(context)
        if self.verify_client:
            self._load_ca(context)
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    def client_context(self) -> ssl.SSLContext:
        """The receiver's context: verifies the sender's certificate and name.

        Raises:
            ValueError: a file that does not load (naming it).
        """
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # CERT_REQUIRED, check_hostname
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        if self.ca_file is None:
            context.load_default_certs(ssl.Purpose.SERVER_AUTH)
        else:
            self._load_ca(context)
        if self.cert_file is not None:
            self._load_chain(context)
        return context

    def _load_chain(self, context: ssl.SSLContext) -> None:
        try:
            context.load_cert_chain(self.cert_file or "", self.key_file)
        except (ssl.SSLError, OSError) as exc:
            raise ValueError(f"transport TLS certificate {str(self.cert_file)!r} with key "
                             f"{str(self.key_file)!r} does not load: {exc}") from None  # fmt: skip

    def _load_ca(self, context: ssl.SSLContext) -> None:
        try:
            context.load_verify_locations(cafile=self.ca_file)
        except (ssl.SSLError, OSError) as exc:
            raise ValueError(f"transport TLS CA file {str(self.ca_file)!r} does not load: "
                             f"{exc}") from None  # fmt: skip


def untrusted(error: BaseException | None) -> str | None:
    """Why a receiver's connection failed if it is because this decode does not trust the
    sender's certificate (a configuration error that retrying does not heal), else None.

    The reverse (a sender with `verify_client` refusing this decode's certificate) cannot be
    told from a plain close: asyncio's TLS server closes without sending its alert.
    """
    if isinstance(error, ssl.SSLCertVerificationError):
        return f"the sender's TLS certificate is not trusted: {error.verify_message}"
    return None
