"""Settling a consuming connection's deliveries with few frames.

Theory of operation
-------------------
Acks are coalesced: settled deliveries share one ``basic.ack`` with ``multiple`` up to the
highest delivery tag below which everything is settled (a delivery still in flight is never
covered), written once ``batch`` deliveries are settled (a quarter of the prefetch window) or
``ACK_DELAY`` after the first of them, whichever comes first, so the broker's window never
starves and a lone message is acked promptly; what waits behind a delivery still in flight is
written with the settle that frees it. A requeue (``basic.reject``) is written at once; its tag
is no longer the broker's, so a later ``multiple`` ack skips it. ``flush`` writes what is due
(a closing link calls it before the connection goes: what was settled is not delivered again).
"""

from __future__ import annotations

import asyncio
import collections

from pamqp import commands

from broker.links.wire import Wire

ACK_DELAY = 0.05  # seconds a settled delivery waits for others to share its ``basic.ack``


class Acker:
    def __init__(self, wire: Wire, prefetch: int) -> None:
        self.wire: Wire | None = wire
        self.batch = max(1, prefetch // 4)
        self.delivered: collections.deque[int] = collections.deque()  # unsettled tags, in order
        self.settled: set[int] = set()  # settled, not yet covered by a multiple ack
        self.timer: asyncio.TimerHandle | None = None
        wire.track = self.delivered.append

    def settle(self, tag: int, ok: bool) -> None:
        wire = self.wire
        if wire is None or wire.lost.done():
            return  # gone: the broker gives the delivery back itself
        self.settled.add(tag)
        if not ok:
            wire.write(wire.channel, commands.Basic.Reject(delivery_tag=tag, requeue=True))
        if len(self.settled) >= self.batch:
            self.flush()
        elif self.timer is None:
            self.timer = asyncio.get_running_loop().call_later(ACK_DELAY, self.flush)

    def flush(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        wire, delivered, settled = self.wire, self.delivered, self.settled
        upto = 0
        while delivered and delivered[0] in settled:
            upto = delivered.popleft()
            settled.discard(upto)
        if upto and wire is not None and not wire.lost.done():
            wire.write(wire.channel, commands.Basic.Ack(delivery_tag=upto, multiple=True))

    def close(self) -> None:
        """Write what is due, then settle nothing more (the connection is about to go)."""
        self.flush()
        if self.wire is not None:
            self.wire.track = None
        self.wire = None
