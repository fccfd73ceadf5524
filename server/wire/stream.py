"""One gRPC call on an HTTP/2 connection: its request headers, the messages received, what is left to send.

:class:`server.wire.h2.Connection` fills a stream from the frames it parses and drains what the call
sends by the peer's windows; the call's handler reads its messages with :meth:`Stream.next_message`.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from server.wire.h2 import Connection

DEFAULT_WINDOW = 65_535  # RFC 9113's initial flow-control window, which this server never changes


class Stream:
    """One gRPC call: its request headers, the messages received, and what is left to send."""

    __slots__ = (
        "buf",
        "closed",
        "conn",
        "ended",
        "headers",
        "headers_sent",
        "id",
        "messages",
        "on_reset",
        "owed",
        "path",
        "pending",
        "reset",
        "send_window",
        "task",
        "timeout",
        "timer",
        "waiter",
    )

    def __init__(self, conn: Connection, stream_id: int, send_window: int) -> None:
        self.conn = conn
        self.id = stream_id
        self.headers: dict[bytes, bytes] = {}
        self.path = ""
        self.timeout: float | None = None
        self.buf = bytearray()
        self.messages: deque[bytes] = deque()
        self.ended = False  # the peer half-closed (END_STREAM)
        self.reset = False  # the peer reset it, or the connection is gone
        self.closed = False  # our side finished (trailers sent or reset)
        self.waiter: asyncio.Future[None] | None = None
        self.send_window = send_window
        self.pending: deque[tuple[bytes, bool]] = deque()  # (frame payload, end) waiting for window
        self.owed = 0  # receive credit not yet given back (an unread message is queued)
        self.task: asyncio.Task[None] | None = None
        self.on_reset: Any = None
        self.headers_sent = False
        self.timer: asyncio.TimerHandle | None = None  # the call's deadline

    def _wake(self) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def next_message(self) -> bytes | None:
        """The next request message, or None once the peer half-closed."""
        while True:
            if self.reset:
                raise asyncio.CancelledError
            if self.messages:
                msg = self.messages.popleft()
                if not self.messages and self.owed >= DEFAULT_WINDOW // 2:
                    self.conn._credit_stream(self, self.owed)
                    self.owed = 0
                self.conn.buffered -= len(msg)
                return msg
            if self.ended:
                return None
            self.waiter = self.conn.loop.create_future()
            await self.waiter
