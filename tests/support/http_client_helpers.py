"""What the HTTP client tests share: default timeouts, a collecting `ResponseHandler`, and
small wire helpers."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

TIMEOUTS = {"connect_s": 2.0, "read_s": 2.0, "total_s": 5.0}
CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"


class Collect:
    """A `ResponseHandler` that keeps what it is handed: every status, the body pieces in
    arrival order, and every `on_end` outcome; `ended` resolves on the first `on_end`,
    `got_body` is set at each piece."""

    def __init__(self) -> None:
        self.heads: list[int] = []
        self.pieces: list[bytes] = []
        self.ends: list[BaseException | None] = []
        self.got_body = asyncio.Event()
        self.ended: asyncio.Future[BaseException | None] = (
            asyncio.get_running_loop().create_future()
        )

    def on_head(self, status: int) -> None:
        self.heads.append(status)

    def on_body(self, data: bytes) -> None:
        self.pieces.append(data)
        self.got_body.set()

    def on_end(self, error: BaseException | None) -> None:
        self.ends.append(error)
        if not self.ended.done():
            self.ended.set_result(error)

    async def outcome(self) -> BaseException | None:
        """The `on_end` outcome, checked to come once."""
        error = await asyncio.wait_for(self.ended, 10)
        await asyncio.sleep(0.02)
        assert self.ends == [error]
        return error


async def within(waiting: Awaitable[object], wait_s: float) -> bool:
    """Whether `waiting` finished within `wait_s`."""
    try:
        await asyncio.wait_for(waiting, wait_s)
    except TimeoutError:
        return False
    return True


def chunk(data: bytes, extension: bytes = b"") -> bytes:
    """`data` as one chunk of a chunked body."""
    return b"%x%s\r\n%s\r\n" % (len(data), extension, data)
