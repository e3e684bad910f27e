"""LMQ's front-end settings and its share of the broker's memory budget: bodies pass the memory
gate AMQP bodies pass.

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
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from broker.auth.users import UserStore
from broker.lmq.engine import LMQError, Peer


class BodyGate(Protocol):
    """The memory gate's interface (``broker.amqp.memory.MemoryAlarm``)."""

    limit: int

    def request(self, who: Any, held: int, wanted: int) -> bool: ...

    def release(self, who: Any, held: int) -> None: ...


@dataclass(frozen=True)
class Settings:
    """What both LMQ front ends need besides the engine: the users (and whether credentials are
    required, or whom a request without them acts as), the tunnel map of a cluster leader, the
    memory gate, and the limits (seconds for a request, RPC requests and bytes in progress)."""

    users: UserStore
    auth: bool
    anonymous_user: str
    peers: Mapping[Peer, Peer]
    gate: BodyGate | None
    request_timeout: float
    max_pipelined: int = 128
    max_bytes_in_flight: int = 256 << 20


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
            async with asyncio.timeout(timeout):
                await who.event.wait()
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
