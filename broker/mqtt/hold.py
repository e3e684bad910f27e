"""Publishers go at the pace of the consumers they feed: the MQTT listener's publisher hold.

Theory of operation
-------------------
One event loop reads every connection once per turn. With many publishers feeding one
subscriber (fan-in), a turn reads every publisher's burst (each QoS 1 publisher has its in-flight
window of PUBLISHes ready the moment its PUBACKs arrive) and the subscriber, which can take only
``[mqtt] prefetch`` deliveries per round trip, gets one round trip per turn: with 1,000
publishers a turn took seconds on a loaded machine and the subscriber received 2 msg/s while its
queue grew without bound (benchmarks/mqtt.py). The AMQP listener holds such a publisher for a
few milliseconds (``broker/net/server.py``); here the hold is by backlog:

- after a read whose publishes reached a queue that has consumers and more than ``BACKLOG``
  messages ready, the listener stops reading that publisher and queues it here;
- every ``TICK`` seconds the held publishers are looked at in the order they were held: one is
  read again when each consumed queue it fed has room for as many messages as its last read
  brought, counting what the publishers let go in this same tick (so a drained queue lets a
  few publishers go, not all of them at once), or when it has waited ``LONGEST`` seconds
  (a consumer that never acks slows its publishers, it never stops them; their keepalive is
  far longer). The first one that may not go ends the tick: the order is kept.

Nothing is dropped or refused: a held publisher's bytes wait in its socket (TCP flow control
slows the client) and a QoS 1 client waits for PUBACKs it is owed anyway. Queues without
consumers (offline persistent sessions) never hold anyone.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Protocol

from broker.model.queue import Queue

BACKLOG = 1000  # ready messages a consumed queue may hold before those feeding it wait
TICK = 0.005  # seconds between looks at the held publishers
LONGEST = 0.5  # seconds a publisher is held at most


class Holdable(Protocol):
    def read_again(self) -> None: ...


class PublisherHold:
    def __init__(self, backlog: int = BACKLOG, tick: float = TICK, longest: float = LONGEST,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.backlog = backlog
        self.tick = tick
        self.longest = longest
        self.clock = clock
        self.held: deque[tuple[float, Holdable, list[Queue], int]] = deque()
        self._timer: asyncio.TimerHandle | None = None

    def backlogged(self, queues: Iterable[Queue]) -> bool:
        backlog = self.backlog
        return any(q.consumers and q.store.ready_count > backlog for q in queues)

    def hold(self, conn: Holdable, queues: Iterable[Queue], n: int) -> None:
        """``conn`` stopped reading after a read of ``n`` publishes into ``queues``; it is
        read again (``read_again``) when they have room or ``longest`` has passed."""
        self.held.append((self.clock() + self.longest, conn, list(queues), max(1, n)))
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.tick, self._look)

    def _look(self) -> None:
        self._timer = None
        now = self.clock()
        let_go: dict[Queue, int] = {}
        held = self.held
        while held:
            until, conn, queues, n = held[0]
            if now < until and not self._room(queues, n, let_go):
                break
            held.popleft()
            conn.read_again()
        if held:
            self._timer = asyncio.get_running_loop().call_later(self.tick, self._look)

    def _room(self, queues: list[Queue], n: int, let_go: dict[Queue, int]) -> bool:
        consumed = [q for q in queues if q.consumers]
        if any(q.store.ready_count + let_go.get(q, 0) + n > self.backlog for q in consumed):
            return False
        for q in consumed:
            let_go[q] = let_go.get(q, 0) + n
        return True

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        held, self.held = self.held, deque()
        for _, conn, _, _ in held:
            conn.read_again()
