"""LMQ's share of the broker's memory budget: bodies pass the memory gate AMQP bodies pass.

Theory of operation
-------------------
Over AMQP, a connection whose content header announces a body asks the memory gate
(``broker.amqp.memory.MemoryAlarm``, handed in by the composition root as a ``BodyGate``) for
those bytes before it reads them; above the high watermark it is not read until earlier bodies
are complete. LMQ does the same with an HTTP body's ``Content-Length`` and an RPC request's size:
``admitted_bytes`` asks for the bytes, waits (at most ``timeout`` seconds, then 503) while the
gate says no, and gives them back when the request is done. With the watermark off (limit 0)
nothing is asked. Together with ``max_message_size`` per message, a cap on RPC requests in
progress per connection and the request timeout, a client's memory is bounded.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Protocol

from broker.lmq.engine import LMQError


class BodyGate(Protocol):
    """The memory gate's interface (``broker.amqp.memory.MemoryAlarm``)."""

    limit: int

    def request(self, who: Any, held: int, wanted: int) -> bool: ...

    def release(self, who: Any, held: int) -> None: ...


class _Waiter:
    def __init__(self) -> None:
        self.event = asyncio.Event()

    def admitted(self, total: int) -> None:
        self.event.set()


@asynccontextmanager
async def admitted_bytes(gate: BodyGate | None, size: int, timeout: float) -> AsyncIterator[None]:
    """Hold ``size`` bytes of the memory gate for the duration (503 when not admitted in time)."""
    if gate is None or not gate.limit or size <= 0:
        yield
        return
    who = _Waiter()
    if not gate.request(who, 0, size):
        try:
            await asyncio.wait_for(who.event.wait(), timeout)
        except TimeoutError:
            if not who.event.is_set():
                gate.release(who, 0)
                raise LMQError(503, "memory high watermark: the body was not admitted in time") from None
        except BaseException:
            gate.release(who, size if who.event.is_set() else 0)
            raise
    try:
        yield
    finally:
        gate.release(who, size)
