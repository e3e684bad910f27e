"""Publishing a turn's messages into this broker: the model's batch operation, one group commit.

Theory of operation
-------------------
A link's source hands over a whole socket read of deliveries at once. The messages ``add``-ed in
one event-loop turn are published together at the end of the turn, in their order, as an AMQP
session publishes a client's run of publishes: ``VHost.publish_batch`` takes as many as it can
at once (routed once per routing key, each queue's part appended as a run), and a message it
leaves (an exchange or queue with a behaviour of its own, an expiration, CC/BCC) goes through
``VHost.publish`` alone, in its place. With ``confirm``, a message that reached durable storage
is ``OK`` once the group commit made it durable (``after_sync``: **one wait for the whole
turn**, not an fsync per message); without, once published. A queue that refused it
(``reject-publish`` overflow) is ``RETRY``. An unroutable message is ``OK``, as a publisher
confirm says for one published without ``mandatory``. A publish that fails (no such exchange,
a full disk) ends the run: ``on_fail`` gets the reason and every message of the turn not yet
answered gets ``RETRY`` (its source gives it back).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Collection
from typing import Any, Protocol

from broker import errors
from broker.links.message import EndLost, Message, Verdict
from broker.model.publish import Names, PublishRequest
from broker.model.vhost import VHost


class AfterSync(Protocol):
    def __call__(self, callback: Callable[[bool], None], deps: Collection[Any] | None = None) -> None: ...


class _Keyed(Names):
    """An exchange and routing key, encoded once, with the routing key that routes
    (``publish_api.KeyedNames``)."""

    __slots__ = ("routing_key",)

    def __init__(self, exchange: str, routing_key: str) -> None:
        super().__init__(exchange, routing_key)
        self.routing_key = routing_key


NAMES_KEPT = 4096  # encoded exchange/routing-key pairs a destination remembers (then starts over)


NAMES_KEPT = 4096  # encoded exchange/routing-key pairs a publisher remembers (then starts over)


class TurnPublisher:
    def __init__(self, vhost: Callable[[], VHost | None], after_sync: AfterSync, confirm: bool,
                 on_fail: Callable[[str], None]) -> None:
        self.vhost = vhost  # the vhost to publish to, None once it is gone
        self.after_sync = after_sync
        self.confirm = confirm
        self.on_fail = on_fail
        self.problem = ""  # why the last message was not OK
        self.names: dict[tuple[str, str], _Keyed] = {}
        self.batch: list[tuple[Message, Callable[[Verdict], None]]] = []  # this turn's messages
        self.answered = 0  # messages of the batch being published that were answered so far
        self.waiting: list[Callable[[Verdict], None]] = []  # messages of this turn awaiting the commit
        self.deps: set[Any] = set()  # the stores they went to

    def add(self, msg: Message, later: Callable[[Verdict], None]) -> None:
        """Take ``msg`` into this turn's batch: ``later`` gets the verdict once it is published
        (and, with ``confirm``, durable)."""
        if not self.batch:
            asyncio.get_running_loop().call_soon(self._publish_batch)
        self.batch.append((msg, later))

    def _keyed(self, exchange: str, routing_key: str) -> _Keyed:
        names = self.names.get((exchange, routing_key))
        if names is None:
            if len(self.names) >= NAMES_KEPT:
                self.names.clear()
            names = self.names[(exchange, routing_key)] = _Keyed(exchange, routing_key)
        return names

    def _publish_batch(self) -> None:
        """Publish this turn's sends in order: runs to one exchange through ``publish_batch``,
        what it leaves one by one; then one group-commit wait for those that need it."""
        batch, self.batch = self.batch, []
        vh = self.vhost()
        self.answered = 0  # sends of the batch answered (or waiting for the commit) so far
        try:
            if vh is None:
                raise EndLost("destination vhost is gone")
            i, n = 0, len(batch)
            ts = int(time.time() * 1000)
            while i < n:
                exchange = batch[i][0].exchange
                j = i + 1
                while j < n and batch[j][0].exchange == exchange:
                    j += 1
                self._publish_run(vh, exchange, batch[i:j], ts)
                i = j
        except Exception as exc:  # noqa: BLE001 - EndLost, or a bug: the run ends either way
            reason = str(exc) if isinstance(exc, EndLost) else f"destination: {type(exc).__name__}: {exc}"
            self.on_fail(reason)  # the run ends; the source gives back what it did not settle
            left = self.waiting + [later for _, later in batch[self.answered:]]
            self.waiting, self.deps = [], set()
            for later in left:
                later(Verdict.RETRY)  # (the closing run settles none of them)
            return
        if self.waiting:
            self._wait_for_commit()

    def _publish_run(self, vh: VHost, exchange: str, part: list[tuple[Message, Callable[[Verdict], None]]],
                     ts: int) -> None:
        """Messages to one exchange: as many as ``VHost.publish_batch`` takes at once, the one it
        leaves through ``VHost.publish``, and so on (as an AMQP session does)."""
        keys = [self._keyed(exchange, m.routing_key) for m, _ in part]
        props = [m.raw for m, _ in part]
        bodies = [m.body for m, _ in part]
        confirm = self.confirm
        i, n, base = 0, len(part), self.answered
        while i < n:
            try:
                out = vh.publish_batch(exchange, keys, props, bodies, ts, i)
            except (errors.DiskFull, OSError) as exc:
                if not errors.no_space(exc):
                    raise
                out = None  # nothing of it is stored (room first): one by one, each stored or refused
            if out is not None and out.done > i:
                done = out.done
                self.answered = base + done
                if out.sync and confirm:
                    self.waiting.extend(later for _, later in part[i:done])
                    self.deps.update(q.store for q in out.queues)
                else:
                    for _, later in part[i:done]:
                        later(Verdict.OK)
                i = done
            if i < n:
                self._publish_one(vh, part[i], keys[i], ts)
                i += 1
                self.answered = base + i

    def _publish_one(self, vh: VHost, item: tuple[Message, Callable[[Verdict], None]], names: _Keyed,
                     ts: int) -> None:
        msg, later = item
        try:
            outcome = vh.publish(PublishRequest(msg.exchange, msg.routing_key, msg.raw, msg.body, ts,
                                                names=names))
        except errors.AMQPError as exc:  # no such exchange...
            raise EndLost(f"destination: {exc.reply_text}") from None
        except (errors.DiskFull, OSError) as exc:
            if not errors.no_space(exc):
                raise
            raise EndLost("destination: disk full") from None
        if outcome.rejected:
            self.problem = "a destination queue refused a message (reject-publish at its limit): retrying"
            later(Verdict.RETRY)
        elif outcome.sync and self.confirm:
            self.waiting.append(later)
            self.deps.update(q.store for q in outcome.queues)
        else:
            later(Verdict.OK)

    def _wait_for_commit(self) -> None:
        """One group-commit wait for every send of the turn: it covers everything written
        before it is registered."""
        waiting, deps = self.waiting, self.deps
        self.waiting, self.deps = [], set()

        def synced(ok: bool) -> None:
            if not ok:
                self.problem = "the destination could not make a message durable: retrying"
            verdict = Verdict.OK if ok else Verdict.RETRY
            for later in waiting:
                later(verdict)

        self.after_sync(synced, deps)

