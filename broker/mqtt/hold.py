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
  messages ready, the listener stops reading that publisher and queues it here, behind that
  queue (one line per queue, so publishers of other queues never wait behind it);
- every ``TICK`` seconds the head of each line is looked at: it is read again when each consumed
  queue it fed has room for as many messages as its last read brought, counting what this tick
  let go already (a drained queue lets a few publishers go, not all 1,000 at once), and the
  next one is looked at; the first that may not go ends its line's turn (the order is kept);
- a line whose queue's consumers took nothing for ``LONGEST`` seconds is let go whole, and that
  queue holds nobody until its consumers take something again (``stalled``): holding
  publishers only helps consumers that are waiting for loop turns, not one that does not read
  its socket or ack (its messages wait in its queue, as without the hold). While the consumers
  take messages the publishers wait as long as the backlog lasts; the keepalive check counts a
  held connection as alive (its bytes wait in its socket, unread by us).

A loop turn also takes at most ``TURN`` PUBLISHes: past that, a read's remaining packets (it is
parsed already) wait for the next turn, in the order the connections came. Without it the
first turn of a fan-in, before any queue has a backlog, took every publisher's whole burst
(10,000 QoS 1 publishes, seconds on a loaded machine). A connection let go by either rule
waits in the other when it meets it.

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
LONGEST = 0.5  # seconds a line is held while its queue's consumers take nothing
FORGET = 60.0  # seconds a stalled queue is remembered as stalled at most
TURN = 100  # PUBLISHes taken in one loop turn; the rest of a read waits for the next turn


class Holdable(Protocol):
    def read_again(self) -> None: ...


class _Line:
    """The publishers held behind one queue, and when its consumers last took something."""

    __slots__ = ("waiting", "delivered", "moved")

    def __init__(self, q: Queue, now: float) -> None:
        self.waiting: deque[tuple[Holdable, list[Queue], int]] = deque()
        self.delivered = q.n_delivered
        self.moved = now


class PublisherHold:
    def __init__(self, backlog: int = BACKLOG, tick: float = TICK, longest: float = LONGEST,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.backlog = backlog
        self.tick = tick
        self.longest = longest
        self.clock = clock
        self.lines: dict[Queue, _Line] = {}
        # queues whose consumers stalled: their delivered count then, and when (forgotten after
        # ``FORGET`` seconds, so a deleted queue is not kept)
        self.stalled: dict[Queue, tuple[int, float]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self.turn_limit = TURN
        self.turn = 0  # PUBLISHes taken in this loop turn
        self.next_turn: deque[Holdable] = deque()

    # ------------------------------------------------------------------ the loop turn's budget
    def count(self, n: int = 1) -> None:
        """``n`` PUBLISHes taken in this loop turn."""
        if not self.turn:
            asyncio.get_running_loop().call_soon(self._new_turn)  # after this turn's reads
        self.turn += n

    def turn_full(self) -> bool:
        return self.turn >= self.turn_limit

    def turn_left(self) -> int:
        """PUBLISHes this loop turn may still take."""
        return self.turn_limit - self.turn

    def wait_turn(self, conn: Holdable) -> None:
        """``conn`` stopped in the middle of a read: this turn took ``TURN`` publishes."""
        self.next_turn.append(conn)

    def _new_turn(self) -> None:
        self.turn = 0
        waiting = self.next_turn
        while waiting and self.turn < self.turn_limit:
            waiting.popleft().read_again()  # may wait again (``wait_turn``) when it is over

    # ------------------------------------------------------------------ backlogged queues

    def _over(self, queues: Iterable[Queue]) -> Queue | None:
        backlog = self.backlog
        return next((q for q in queues if q.consumers and q.store.ready_count > backlog
                     and not self._stalled(q)), None)

    def _stalled(self, q: Queue) -> bool:
        seen = self.stalled.get(q)
        if seen is None:
            return False
        if q.n_delivered == seen[0] and self.clock() - seen[1] < FORGET:
            return True
        del self.stalled[q]
        return False

    def backlogged(self, queues: Iterable[Queue]) -> bool:
        return self._over(queues) is not None

    def hold(self, conn: Holdable, queues: Iterable[Queue], n: int) -> None:
        """``conn`` stopped reading after a read of ``n`` publishes into ``queues``; it is
        read again (``read_again``) when they have room or their consumers stall."""
        fed = list(queues)
        q = self._over(fed)
        if q is None:
            conn.read_again()
            return
        line = self.lines.get(q)
        if line is None:
            line = self.lines[q] = _Line(q, self.clock())
        line.waiting.append((conn, fed, max(1, n)))
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.tick, self._look)

    def _look(self) -> None:
        self._timer = None
        now = self.clock()
        let_go: dict[Queue, int] = {}
        for q, line in list(self.lines.items()):
            waiting = line.waiting
            if q.n_delivered != line.delivered:
                line.delivered, line.moved = q.n_delivered, now
            if now - line.moved >= self.longest:  # stalled: all go, and it holds nobody for now
                line.waiting, line.moved = deque(), now
                self.stalled[q] = (q.n_delivered, now)
                for conn, _, _ in waiting:
                    conn.read_again()
            else:
                while waiting:
                    conn, queues, n = waiting[0]
                    if not self._room(queues, n, let_go):
                        break
                    waiting.popleft()
                    conn.read_again()
            if not line.waiting:
                del self.lines[q]
        if self.lines:
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
        waiting, self.next_turn = self.next_turn, deque()
        for conn in waiting:
            conn.read_again()
        lines, self.lines = self.lines, {}
        for line in lines.values():
            for conn, _, _ in line.waiting:
                conn.read_again()
