"""Errors of the KV transport."""

from __future__ import annotations


class TransferError(RuntimeError):
    """A transfer failed: timeout, abort, corruption or an unrecoverable connection loss.

    The message names the room and the cause. A transfer that raised never hands over data.
    """

    def __init__(self, room: int, message: str) -> None:
        super().__init__(f"room {room}: {message}")
        self.room = room
        self.reason = message


class ProtocolError(ValueError):
    """Bytes on a connection are not a valid frame (bad magic, header check, length)."""
