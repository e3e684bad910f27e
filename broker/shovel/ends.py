"""What a shovel's two ends are to the link that joins them.

A **source** consumes with at most ``prefetch`` messages unsettled, hands each to the link's
callback, and settles each as the link says: ``ACK`` (the destination has it), ``REQUEUE`` (give
it back), ``DEAD_LETTER`` (refused for good: only when the source queue has a dead-letter
exchange, otherwise the link requeues). A **destination** publishes one message and says
``OK``, ``RETRY`` (refused for now: flow control, a ``reject-publish`` queue at its limit, an HTTP
5xx, a nack) or ``REFUSED`` (refused for good: an HTTP 4xx other than 408/429); it raises
``EndLost`` when its connection is gone (nothing settled: the source gives every unsettled
message back when the link closes it). Either end's ``lost`` future is set with the reason
when it breaks on its own.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable
from typing import Protocol

from broker.links.message import (
    CONNECT_TIMEOUT,
    EMPTY_PROPERTIES,
    OP_TIMEOUT,
    EndLost,
    Message,
    Verdict,
    new_lost,
    set_lost,
)

__all__ = ["CONNECT_TIMEOUT", "EMPTY_PROPERTIES", "OP_TIMEOUT", "Destination", "EndLost", "Message", "Settle",
           "Source", "Verdict", "new_lost", "set_lost"]


class Settle(enum.Enum):
    ACK = "ack"
    REQUEUE = "requeue"
    DEAD_LETTER = "dead-letter"


class Source(Protocol):
    lost: asyncio.Future[str]
    can_dead_letter: bool  # the source queue has a dead-letter exchange
    length: int  # messages in the source queue when it was opened (src-delete-after queue-length)

    async def open(self, on_message: Callable[[Message], None]) -> None: ...

    def settle(self, tag: int, how: Settle) -> None: ...

    async def close(self) -> None: ...


class Destination(Protocol):
    lost: asyncio.Future[str]
    concurrency: int  # publishes it may have in flight at once (1: strictly in order, one by one)
    @property
    def problem(self) -> str:
        """Why the last send was not OK (the status's reason while the link retries)."""
        ...

    async def open(self) -> None: ...

    immediate: bool  # send_now publishes at once (this broker): the link needs no task per message

    async def send(self, msg: Message) -> Verdict: ...

    def send_now(self, msg: Message, later: Callable[[Verdict], None]) -> Verdict | None:
        """Only when ``immediate``: publish now; the verdict, or None when ``later`` gets it."""

    async def close(self) -> None: ...
