"""Decode side: `KVReceiver` keeps one connection pool (`ReceiverLink`) per prefill sender."""

from __future__ import annotations

import math

from prfaas.engines.transport.config import ReceiverConfig
from prfaas.engines.transport.receiver_link import ReceiverLink
from prfaas.engines.transport.receiver_transfer import LayerItem, Transfer, TransferResult
from prfaas.engines.transport.sender_room import check_room

__all__ = ["KVReceiver", "LayerItem", "Transfer", "TransferResult"]


class KVReceiver:
    """One per decode engine process: one connection pool per prefill sender address."""

    def __init__(self, config: ReceiverConfig | None = None) -> None:
        """Raises ValueError when a TLS certificate, key or CA file does not load."""
        self.config = config or ReceiverConfig()
        tls = self.config.tls
        self._tls_context = tls.client_context() if tls is not None else None
        self._links: dict[tuple[str, int], ReceiverLink] = {}

    async def fetch(
        self, bootstrap_host: str, bootstrap_port: int, room: int, *, timeout_s: float = 60.0
    ) -> Transfer:
        """Register for `room` at the sender and return its handle at once.

        The sender may not be up yet (either start order works): connecting is retried in
        the background. The whole transfer must complete within `timeout_s`, else it fails
        with TransferError on both sides.

        Raises:
            ValueError: bad address, room or timeout, or the room is already being fetched.
        """
        check_room(room)
        if not (math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        if not 0 < bootstrap_port <= 65535:
            raise ValueError(f"bootstrap_port must be in 1..65535, got {bootstrap_port}")
        key = (bootstrap_host, bootstrap_port)
        link = self._links.get(key)
        if link is None or link.closed:
            link = ReceiverLink(bootstrap_host, bootstrap_port, self.config, self._tls_context)
            self._links[key] = link
        if room in link.transfers:
            raise ValueError(f"room {room} is already being fetched from {key}")
        transfer = Transfer(room, link, timeout_s)
        link.add(transfer)
        return transfer

    async def close(self) -> None:
        """Fail open transfers and close all connections; idempotent."""
        for link in list(self._links.values()):
            await link.close()
        self._links.clear()
