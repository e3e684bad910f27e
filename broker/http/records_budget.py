"""A process-wide bound on the bytes of raw record answers in flight (``routes_stream_records``).

Theory of operation
-------------------
An answer of ``GET .../records`` is copied out of the segment map into one bytes object and
held until the transport has sent it. Without a bound, N clients asking large answers (and
reading them slowly, or not at all) make the process hold N times the answer size. So every
answer takes its size from one byte budget (``[mgmt] records_memory``) before it reads, and
gives it back when the answer has left (sent, or the connection cut). A request that finds too
little budget waits, first come first served, at most ``[mgmt] records_wait`` seconds and is
then answered 503 with Retry-After (nothing read, so nothing happened). Asking more than the
whole budget is asked for the whole budget (the answer is then smaller, which the format allows:
the client asks again from first + count). A single record larger than what was taken is still
answered whole (the store holds it, so it is within the message size limit); its extra bytes
are counted at once, over the limit, and held back from the next waiters.

The time bound is the send timeout (``[mgmt] records_send_timeout``): an answer not sent
within it has its connection aborted, which drops the transport's buffer and gives the budget
back, so a client that stops reading pins neither memory nor a segment for longer.
"""

from __future__ import annotations

import asyncio
from collections import deque


class ByteBudget:
    """Bytes taken and given back, with first-come-first-served waiters."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    async def take(self, n: int, wait: float) -> bool:
        """Take ``n`` bytes (at most ``limit``), waiting at most ``wait`` seconds; False when
        they were not free in time (nothing taken)."""
        n = min(n, self.limit)
        if not self._waiters and self.used + n <= self.limit:
            self.used += n
            return True
        if wait <= 0:
            return False
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (n, fut)
        self._waiters.append(entry)
        granted = False
        try:
            async with asyncio.timeout(wait):
                await fut
            granted = True
        except TimeoutError:
            pass
        finally:
            if not granted:
                if fut.done() and not fut.cancelled():  # granted as the wait ended
                    self.give(n)
                else:
                    fut.cancel()
                    self._waiters.remove(entry)
                    self._grant()  # a large waiter leaving may let smaller ones in
        return granted

    def resize(self, held: int, now: int) -> int:
        """Hold ``now`` bytes instead of ``held`` (the answer's real size), returning ``now``:
        less gives the rest back; more is counted at once, over the limit if need be."""
        self.used += now - held
        if now < held:
            self._grant()
        return now

    def give(self, n: int) -> None:
        self.used -= n
        self._grant()

    def _grant(self) -> None:
        while self._waiters and self.used + self._waiters[0][0] <= self.limit:
            n, fut = self._waiters.popleft()
            self.used += n
            fut.set_result(None)


class RecordsBounds:
    """The records endpoint's bounds as configured (``[mgmt] records_*``)."""

    def __init__(self, memory: int = 256 << 20, wait: float = 10.0, send_timeout: float = 60.0) -> None:
        self.budget = ByteBudget(memory)
        self.wait = wait
        self.send_timeout = send_timeout
