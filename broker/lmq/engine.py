"""LMQ's semantics over the broker's queues: put, take, visibility timeout, retry, accumulation.

Theory of operation
-------------------
An LMQ queue is an ordinary durable queue of the vhost (created on first use). A **put** stores
the body with its content type and, in headers, the queue's effective ``retry`` and ``timeout``
at that moment (``x-lmq-retry``, ``x-lmq-timeout``), through the one publish operation
(``VHost.publish``), and is answered only after the group commit (``after_sync``), like a
publisher confirm: an answered put survives kill -9.

A **take** is the queue's own ``get``: the message becomes unacknowledged in the queue (so it
comes back after a crash, as any unacked message does) and gets a fresh UUID and a timer of
``timeout`` seconds. ``ack`` settles it; ``ext`` restarts the timer; ``nack`` and the timer's
expiry count one retry and requeue it, or, past ``retry`` retries, settle it as rejected (the
queue dead-letters it if it has a dead-letter exchange). A requeued message is taken again with a
new id, so the old id answers 404, as LMQ's does. Retry counts are kept per stored message in
memory: after a restart a message starts counting again (it is never lost for it).

**Accumulation**: with ``accum`` > 0, the first put opens a window of that many seconds
(``{"accum": "new"}``), later puts join it (``"yes"``), and when it closes every part is stored as
one compound message (content type ``application/x-msgpack``, body ``[[{metadata}, body], ...]``,
header ``x-lmq-type: compound``), taken, acked and retried as one. Parts wait in memory until the
window closes: a put answered ``new``/``yes`` is durable only from then on (documented). A window
closes early when the next part would take it past ``max_message_size`` (the compound message is
one message, under the same limit as any other), which also bounds the memory a window holds.

Long polls wait on an event set by every put and requeue, re-checking at least every 100 ms so
messages that arrive over AMQP are seen too, and end as soon as their client has gone
(``alive``). Every operation takes the ``Access`` of the user it acts for and checks the AMQP
permission it needs before it changes anything (``broker.lmq.access``).

**Regex fan-out** (``qre``, ``pull_any``, ``push_all``): the pattern runs on RE2
(``broker.patterns``, linear time), each queue name is matched once per request (``Matcher``
remembers the answers, so the 100 ms re-checks of a long poll cost a dictionary lookup per
queue), and a scan yields the event loop every ``SCAN_CHUNK`` queues, so a vhost of 50,000
queues never holds up other connections. A take from several queues serves, as LMQ's
``pull_any`` does, whichever queue could hand a message out first: LMQ races one pull per
queue; here the matching queues are tried in name order starting after the queue a fan-out
take served last, so with messages waiting in several, each is served in turn (none starves).

**Limits**: a message body is at most the broker's ``max_message_size`` (413 / an RPC error),
as over AMQP.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgpack
from pamqp import commands

from broker import errors, properties
from broker.auth.names import name_problem
from broker.auth.throttle import check_login
from broker.auth.users import UserStore
from broker.lmq.access import Access, Refused, logged_in
from broker.lmq.props import PropsStore
from broker.model import trace
from broker.model.publish import PublishRequest
from broker.model.publish_api import Origin
from broker.model.queue import Queue
from broker.model.vhost import VHost
from broker.patterns import PatternError, compile_pattern

log = logging.getLogger(__name__)

COMPOUND_TYPE = "application/x-msgpack"
DEFAULT_TYPE = "application/octet-stream"
POLL_MAX = 0.1  # seconds between re-checks of a long poll (messages put over AMQP wake no event)
PART_OVERHEAD = 64  # bytes a compound message spends per part besides its body (metadata, framing)
SCAN_CHUNK = 2000  # queue names a fan-out scan matches before it lets other connections run


class LMQError(Exception):
    """A request LMQ refuses; ``status`` is the HTTP status the HTTP API answers with."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


@dataclass
class Taken:
    """A message handed to a client and not yet settled."""

    id: str
    queue: Queue
    msgid: int
    retry: int
    timeout: float
    timer: asyncio.TimerHandle | None = None


@dataclass
class Message:
    """What a take returns to a protocol front end."""

    queue: str
    id: str
    compound: bool
    content_type: str
    body: bytes
    retry_remaining: int

    def parts(self) -> list[tuple[dict[str, str], bytes]]:
        """A compound message's parts: (metadata, body) pairs in put order."""
        return [(dict(md), bytes(b)) for md, b in msgpack.unpackb(self.body, raw=False)]


@dataclass
class _Window:
    parts: list[list[Any]]
    timer: asyncio.TimerHandle
    size: int = 0  # bytes the compound message will take, about (bodies plus PART_OVERHEAD each)
    who: Origin | None = None  # the put that opened it, as the firehose names the compound's publisher


def _props(content_type: str, headers: dict[str, Any]) -> bytes:
    return properties.encode(commands.Basic.Properties(content_type=content_type, delivery_mode=2,
                                                       headers=headers))


def _read_props(raw: bytes) -> tuple[str, dict[str, Any]]:
    try:
        p = properties.decode(raw)
    except Exception:  # noqa: BLE001 - a message from another protocol with odd properties
        return DEFAULT_TYPE, {}
    return p.content_type or DEFAULT_TYPE, dict(p.headers or {})


Peer = tuple[str, int]


def client_address(peers: Mapping[Peer, Peer], transport: Any) -> str:
    """The client's address of a connection: its peer, or, for a cluster leader's own end of a
    follower's client tunnel, the client the tunnel carries (``broker.cluster.tunnel``)."""
    info = transport.get_extra_info("peername") if transport is not None else None
    if not info:
        return ""
    peer = (str(info[0]), int(info[1]))
    return peers.get(peer, peer)[0]


async def login(users: UserStore, name: str, password: str, peer: str, vhost: str, what: str, *,
                bearer: bool = False) -> Access:
    """The access of ``name``/``password`` logging in from ``peer`` to LMQ's ``vhost`` (the one
    rule of both LMQ front ends), after their turn in the login throttle: Refused (401 bad
    credentials, 403 no vhost access); ``TooManyFailures`` when the throttle refuses it unchecked.
    ``bearer``: ``password`` is an OAuth 2 access token (``broker.auth.oauth``)."""
    user = await check_login(users, name, password, peer, what, bearer=bearer)
    if user is None:
        raise Refused(401, "login failed")
    return logged_in(users, user, vhost)


Alive = Callable[[], bool]


def _always() -> bool:
    return True


class Matcher:
    """The queues of a vhost whose names a client's pattern matches (RE2, each name matched
    once), for one request; ``queues`` yields the event loop every ``SCAN_CHUNK`` names."""

    def __init__(self, vhost: VHost, regex: str, who: Access) -> None:
        try:
            self.pattern = compile_pattern(regex)
        except PatternError as exc:
            raise LMQError(400, str(exc)) from None
        self.vhost = vhost
        self.who = who
        self.known: dict[str, bool] = {}

    async def queues(self) -> list[Queue]:
        out: list[Queue] = []
        known, search = self.known, self.pattern.search
        for i, (name, q) in enumerate(list(self.vhost.queues.items())):
            if i and not i % SCAN_CHUNK:
                await asyncio.sleep(0)
            hit = known.get(name)
            if hit is None:
                hit = known[name] = search(name) and self.who.may_read(name)
            if hit and q.exclusive_owner is None and not q.deleted:
                out.append(q)
        if len(known) > 2 * len(self.vhost.queues) + SCAN_CHUNK:  # deleted queues: forget them
            self.known = {n: known[n] for n in self.vhost.queues if n in known}
        out.sort(key=lambda q: q.name)
        return out


class LMQ:
    def __init__(self, vhost: VHost, props: PropsStore,
                 after_sync: Callable[[Callable[[bool], None]], None],
                 max_message_size: int = 128 << 20) -> None:
        self.vhost = vhost
        self.props = props
        self.after_sync = after_sync
        self.max_message_size = max_message_size
        self.last_any = ""  # the queue a fan-out take served last: the next one starts after it
        self.taken: dict[str, Taken] = {}
        self.retries: dict[tuple[int, int], int] = {}  # (id(queue), msgid) -> retries so far
        self.windows: dict[str, _Window] = {}
        self.counters: Counter[tuple[str, str]] = Counter()  # (queue, put|get|ack) for StatsD
        self._arrived = asyncio.Event()
        self.node_name: Callable[[], str] = lambda: ""  # the node's name (firehose copies); set by the node

    # ------------------------------------------------------------------ queues
    def ensure(self, name: str, who: Access) -> Queue:
        """The queue ``name``, created (durable) on first use as LMQ does (configure permission);
        another connection's exclusive queue is refused (405), as AMQP refuses it."""
        q = self.vhost.queues.get(name)
        if q is None:
            problem = name_problem("queue", name)  # any UTF-8 name of 1 to 255 bytes
            if problem is not None:
                raise LMQError(400, problem)
            who.configure(name)
            q, _ = self.vhost.declare_queue(name, durable=True, owner=None)
        elif q.exclusive_owner is not None:
            raise LMQError(405, f"queue '{name}' in vhost '{self.vhost.name}' is exclusive to another "
                                "connection")
        return q

    def matcher(self, regex: str, who: Access) -> Matcher:
        """The queues ``regex`` picks for ``who`` (400 for a pattern RE2 cannot run)."""
        return Matcher(self.vhost, regex, who)

    def delete(self, name: str, who: Access) -> None:
        who.configure(name)
        if name in self.vhost.queues:
            self.vhost.delete_queue(name, owner=None)
        window = self.windows.pop(name, None)
        if window is not None:
            window.timer.cancel()
        for t in [t for t in self.taken.values() if t.queue.name == name]:
            self._forget(t)

    def origin(self, who: Access) -> Origin:
        """An LMQ client as firehose copies name it."""
        return Origin(self.node_name(), who.name, "LMQ", 0)

    # ------------------------------------------------------------------ put
    async def put(self, name: str, body: bytes, content_type: str | None, who: Access) -> str:
        """Store one message; answer LMQ's accumulation flag: "no", "new" or "yes"."""
        if len(body) > self.max_message_size:
            raise LMQError(413, f"message of {len(body)} bytes is larger than max_message_size "
                                f"({self.max_message_size} bytes)")
        who.write()
        q = self.ensure(name, who)
        props = self.props.resolve(name)
        self.counters[(name, "put")] += 1
        meta = {"content-type": content_type or DEFAULT_TYPE}
        if props["accum"] > 0:
            size = len(body) + PART_OVERHEAD
            window = self.windows.get(name)
            if window is not None and window.size + size > self.max_message_size:
                window.timer.cancel()  # full: it closes now (one message stays within the limit)
                self._close_window(name)
                window = None
            if window is not None:
                window.parts.append([meta, body])
                window.size += size
                return "yes"
            loop = asyncio.get_running_loop()
            timer = loop.call_later(props["accum"], self._close_window, name)
            self.windows[name] = _Window([[meta, body]], timer, size, self.origin(who))
            return "new"
        self._store(q, body, meta["content-type"], props, compound=False, who=self.origin(who))
        await self._synced()
        return "no"

    def _store(self, q: Queue, body: bytes, content_type: str, props: dict[str, Any], compound: bool,
               who: Origin | None) -> None:
        headers: dict[str, Any] = {"x-lmq-retry": props["retry"], "x-lmq-timeout": props["timeout"]}
        if compound:
            headers["x-lmq-type"] = "compound"
        req = PublishRequest("", q.name, _props(content_type, headers), body, int(time.time() * 1000), True,
                             origin=who)
        try:
            out = self.vhost.publish(req)
        except errors.DiskFull:
            raise LMQError(503, f"disk full: message for queue '{q.name}' not stored") from None
        if out.rejected:
            raise LMQError(503, f"queue '{q.name}' refused the message (length limit)")
        self._arrived.set()

    def _close_window(self, name: str) -> None:
        window = self.windows.pop(name, None)
        q = self.vhost.queues.get(name)
        if window is None or q is None:
            return
        try:
            self._store(q, msgpack.packb(window.parts, use_bin_type=True), COMPOUND_TYPE,
                        self.props.resolve(name), compound=True, who=window.who)
        except (LMQError, errors.SkredError) as exc:
            log.error("LMQ queue '%s': compound message of %d parts not stored: %s",
                      name, len(window.parts), exc)

    async def _synced(self) -> None:
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()

        def done(ok: bool) -> None:
            if not fut.done():
                fut.set_result(ok)

        self.after_sync(done)
        if not await fut:
            raise LMQError(503, "the message could not be made durable (disk or replication failure)")

    # ------------------------------------------------------------------ take
    async def take(self, name: str, timeout: float | None, who: Access,
                   alive: Alive = _always) -> Message | None:
        """One message from queue ``name`` (created on first use), as ``take_any``."""
        who.read(name)
        q = self.ensure(name, who)

        async def one() -> list[Queue]:
            return [q]

        return await self._take(one, timeout, alive, fan_out=False, who=who)

    async def take_any(self, regex: str, timeout: float | None, who: Access,
                       alive: Alive = _always) -> Message | None:
        """One message from the queues ``regex`` matches that ``who`` may read, waiting up to
        ``timeout`` seconds (None: until one comes) while ``alive()``; None when the wait ran out
        or the client went away."""
        return await self._take(self.matcher(regex, who).queues, timeout, alive, fan_out=True, who=who)

    async def _take(self, queues: Callable[[], Awaitable[list[Queue]]], timeout: float | None, alive: Alive,
                    fan_out: bool, who: Access) -> Message | None:
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            candidates = await queues()
            if fan_out and candidates:  # the ones after the queue served last first (LMQ's race)
                start = bisect.bisect_right([q.name for q in candidates], self.last_any)
                candidates = candidates[start:] + candidates[:start]
            for q in candidates:
                if q.deleted:
                    continue
                got = q.get()
                if got is not None:
                    if fan_out:
                        self.last_any = q.name
                    return self._hand_out(q, got, who)
            left = POLL_MAX if deadline is None else min(POLL_MAX, deadline - loop.time())
            if left <= 0 or not alive():  # a client that has gone (or half-closed) waits no more
                return None
            self._arrived.clear()
            try:
                async with asyncio.timeout(left):
                    await self._arrived.wait()
            except TimeoutError:
                pass

    def _hand_out(self, q: Queue, got: tuple[int, bytes, bytes, bytes, bytes, bool], who: Access) -> Message:
        msgid, exchange, rk, raw_props, body, redelivered = got
        vh = self.vhost
        if vh.meta.tracing:  # firehose: deliver.<queue>
            trace.delivered(vh, self.origin(who), q.name, exchange, rk, raw_props, body, redelivered,
                            int(time.time() * 1000))
        content_type, headers = _read_props(raw_props)
        current = self.props.resolve(q.name)
        retry = headers.get("x-lmq-retry", current["retry"])
        timeout = headers.get("x-lmq-timeout", current["timeout"])
        retry = int(retry) if isinstance(retry, int | float) else current["retry"]
        timeout = float(timeout) if isinstance(timeout, int | float) and timeout > 0 else current["timeout"]
        t = Taken(str(uuid.uuid4()), q, msgid, retry, timeout)
        t.timer = asyncio.get_running_loop().call_later(timeout, self._expired, t.id)
        self.taken[t.id] = t
        self.counters[(q.name, "get")] += 1
        done = self.retries.get((id(q), msgid), 0)
        return Message(q.name, t.id, headers.get("x-lmq-type") == "compound", content_type, bytes(body),
                       max(0, retry - done))

    # ------------------------------------------------------------------ replies
    def _find(self, name: str, msg_id: str) -> Taken:
        t = self.taken.get(msg_id)
        if t is None or t.queue.name != name or t.queue.deleted:
            raise LMQError(404, f"no message '{msg_id}' taken from queue '{name}' "
                                "(acked, timed out or unknown)")
        return t

    def _forget(self, t: Taken) -> None:
        self.taken.pop(t.id, None)
        if t.timer is not None:
            t.timer.cancel()

    def settle(self, kind: str, name: str, msg_id: str, who: Access) -> None:
        """LMQ's reply to a taken message: ``ack``, ``nack`` or ``ext`` (read permission)."""
        who.read(name)
        {"ack": self.ack, "nack": self.nack, "ext": self.extend}[kind](name, msg_id)

    def ack(self, name: str, msg_id: str) -> None:
        t = self._find(name, msg_id)
        self._forget(t)
        self.retries.pop((id(t.queue), t.msgid), None)
        t.queue.ack(t.msgid)
        self.counters[(name, "ack")] += 1

    def nack(self, name: str, msg_id: str) -> None:
        t = self._find(name, msg_id)
        self._forget(t)
        self._retry(t)

    def extend(self, name: str, msg_id: str) -> None:
        t = self._find(name, msg_id)
        if t.timer is not None:
            t.timer.cancel()
        t.timer = asyncio.get_running_loop().call_later(t.timeout, self._expired, t.id)

    def _expired(self, msg_id: str) -> None:
        t = self.taken.pop(msg_id, None)
        if t is not None:
            self._retry(t)

    def _retry(self, t: Taken) -> None:
        """One more retry: back to the queue (a new id when taken again), or past ``retry``
        retries settled as rejected (dead-lettered when the queue has a dead-letter exchange)."""
        if t.queue.deleted:
            return
        key = (id(t.queue), t.msgid)
        done = self.retries.get(key, 0) + 1
        if done > t.retry:
            self.retries.pop(key, None)
            t.queue.reject(t.msgid, requeue=False)
            log.info("LMQ queue '%s': message discarded after %d retries", t.queue.name, t.retry)
        else:
            self.retries[key] = done
            t.queue.reject(t.msgid, requeue=True)
            self._arrived.set()

    def close(self) -> None:
        """Stop the timers (shutdown): unsettled messages stay unacked and come back on restart."""
        for t in list(self.taken.values()):
            if t.timer is not None:
                t.timer.cancel()
        for name in list(self.windows):
            self.windows[name].timer.cancel()
            self._close_window(name)
