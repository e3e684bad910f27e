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
from dataclasses import dataclass
from typing import Protocol

from pamqp import commands


class Settle(enum.Enum):
    ACK = "ack"
    REQUEUE = "requeue"
    DEAD_LETTER = "dead-letter"


class Verdict(enum.Enum):
    OK = "ok"
    RETRY = "retry"
    REFUSED = "refused"


class EndLost(Exception):
    """An end's connection or channel is gone; the text says why."""


@dataclass(slots=True)
class Message:
    exchange: str
    routing_key: str
    props: commands.Basic.Properties
    body: bytes
    redelivered: bool
    tag: int  # the source's handle to settle it


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
    problem: str  # why the last send was not OK (the status's reason while the link retries)

    async def open(self) -> None: ...

    async def send(self, msg: Message) -> Verdict: ...

    async def close(self) -> None: ...


def new_lost() -> asyncio.Future[str]:
    fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    return fut


def set_lost(fut: asyncio.Future[str], reason: str) -> None:
    if not fut.done():
        fut.set_result(reason)
