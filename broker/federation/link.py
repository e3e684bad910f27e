"""One federation link: a connection to an upstream broker that moves messages into this one.

Theory of operation
-------------------
A link runs as one asyncio task on the node that serves (a cluster's leader: followers run no
broker, so no links; a new leader's broker starts them again from the parameters and policies it
replicated). The task connects to the upstream (each URI of the upstream in turn), sets up what
the link kind needs there (``ExchangeLink``, ``QueueLink``), then consumes with a prefetch of
``prefetch-count`` and hands every delivery to ``forward``, which publishes it here through the
model's one publish operation (``VHost.publish``) and settles it upstream by ``ack-mode``:

- ``on-confirm`` (the default): the upstream ack is sent only once the local copy is durable (the
  group commit, ``after_sync``; in a cluster, replicated to the in-sync followers too). A crash
  of either side or of the link before that leaves the message unacked upstream, so it comes again:
  at-least-once, duplicates only for what was in flight.
- ``on-publish``: acked once published here (lost if this broker crashes before its sync).
- ``no-ack``: the upstream forgets it as it sends it.

A message this broker refuses (a queue's ``reject-publish`` limit, a full disk, a failed sync)
is nacked with requeue, so it stays upstream, and the link restarts after its back-off rather
than spin on it. Every failure (unreachable host, refused login, a channel error) ends the
session; the link waits ``reconnect-delay`` seconds, doubled on every failure in a row up to
``MAX_BACKOFF_FACTOR`` times, before it tries again: never a hot loop. Its status (``starting``,
``running``, ``error`` with the reason) is what ``GET /api/federation-links`` shows.

Every message moved carries ``x-received-from``: a list of tables, one per link it crossed
(``uri`` without password, ``exchange`` or ``queue``, ``redelivered``, ``cluster-name`` of the
upstream, and ``vhost``), which the exchange links read to stop cycles and count hops.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import unquote, urlsplit

import aiormq
from aiormq.abc import DeliveredMessage
from pamqp import commands

from broker import errors
from broker.federation.upstream import Upstream, local_vhost, scrub
from broker.model.publish import PublishRequest
from broker.model.vhost import VHost

log = logging.getLogger(__name__)
# The client library logs every connection an upstream closes with a traceback; the link logs
# the reason in one line and shows it in its status, so the library's own noise is left out.
logging.getLogger("aiormq").setLevel(logging.CRITICAL)

MAX_BACKOFF_FACTOR = 16  # reconnect-delay doubles per failure in a row up to this many times
CONNECT_TIMEOUT = 10.0  # seconds for one connection attempt (TCP, TLS and the AMQP handshake)
CALL_TIMEOUT = 10.0  # seconds for the upstream to answer a declare, bind, consume or cancel
MAX_RECEIVED_FROM = 64  # entries kept in x-received-from: a bound on what a peer can grow

AfterSync = Callable[[Callable[[bool], None], Any], None]


class Refused(Exception):
    """This broker did not take a message: it stays upstream and the link restarts."""


class Link:
    """Base of the two link kinds: the reconnect loop, status, and the local publish."""

    kind = ""

    def __init__(self, vhost: VHost, resource: str, upstream: Upstream, after_sync: AfterSync,
                 cluster_name: str, node: str, vhosts: Mapping[str, VHost]) -> None:
        self.vhost = vhost
        self.vhosts = vhosts  # for an upstream on this broker
        self.resource = resource  # the local exchange or queue
        self.upstream = upstream
        self.after_sync = after_sync
        self.cluster_name = cluster_name
        self.node = node
        self.status = "starting"
        self.error: str | None = None
        self.uri = scrub(upstream.uris[0])
        self.since = time.time()
        self.failures = 0  # in a row; reset by a session that ran
        self.attempts = 0
        self._task: asyncio.Task[None] | None = None
        self._conn: aiormq.abc.AbstractConnection | None = None
        self.upstream_cluster = ""
        self.upstream_vhost = "/"
        self.reached = False  # this session got to "running"
        self._failed: asyncio.Future[None] | None = None  # set when a delivery ends the session

    # ------------------------------------------------------------ life cycle
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"federation {self.resource}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        await self._close()

    async def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None and not conn.is_closed:
            try:
                await asyncio.wait_for(conn.close(), CONNECT_TIMEOUT)
            except Exception:  # a dead peer: the socket goes with the object
                pass

    def _set(self, status: str, error: str | None = None) -> None:
        self.status, self.error, self.since = status, error, time.time()
        self.reached = self.reached or status == "running"

    def fail(self, exc: BaseException) -> None:
        """End the session from a consumer callback (the session task raises ``exc``)."""
        if self._failed is not None and not self._failed.done():
            self._failed.set_exception(exc)

    async def until_failed(self) -> None:
        """Wait while the session runs: until a delivery fails or the connection closes."""
        assert self._failed is not None
        waits: list[asyncio.Future[Any]] = [self._failed]
        if self._conn is not None:  # an in-process link has no connection
            waits.append(asyncio.ensure_future(self._conn.closing))
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits[1:]:
                w.cancel()
        if self._failed.done():
            self._failed.result()

    async def _run(self) -> None:
        while True:
            self.reached = False
            for uri in self.upstream.uris:
                self.attempts += 1
                self.uri = scrub(uri)
                self._set("starting")
                self._failed = asyncio.get_running_loop().create_future()
                try:
                    up_vhost = local_vhost(uri, self.vhost.name)
                    if up_vhost is not None:  # this broker: in-process, through the model
                        await self._local(up_vhost)
                    else:
                        await self._connect(uri)
                        assert self._conn is not None
                        await self._session(self._conn)
                        self._set("error", "the upstream closed the connection")
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # every failure ends the session the same way
                    self._set("error", _reason(exc))
                    log.warning("federation link %s/%s from upstream %r (%s): %s", self.vhost.name,
                                self.resource, self.upstream.name, self.uri, self.error)
                finally:
                    await self._close()
                    failed, self._failed = self._failed, None
                    if failed is not None and failed.done() and not failed.cancelled():
                        failed.exception()  # seen: asyncio would log a late one as never retrieved
                if self.reached:
                    break  # it ran, then failed: back to the first URI after the delay
            self.failures = 1 if self.reached else self.failures + 1
            factor = min(2 ** (self.failures - 1), MAX_BACKOFF_FACTOR)
            await asyncio.sleep(self.upstream.reconnect_delay * factor)

    async def _connect(self, uri: str) -> None:
        name = f"Federation link (upstream: {self.upstream.name}, {self.kind}: {self.resource})"
        conn = await asyncio.wait_for(aiormq.connect(uri, client_properties={
            "connection_name": name, "product": "Skred federation"}), CONNECT_TIMEOUT)
        self._conn = conn
        props = getattr(conn, "server_properties", None) or {}
        cluster = props.get("cluster_name") if isinstance(props, dict) else None
        parts = urlsplit(uri)
        self.upstream_cluster = (cluster.decode() if isinstance(cluster, bytes) else str(cluster)) \
            if cluster else f"{parts.hostname}:{parts.port or 5672}"
        self.upstream_vhost = unquote(parts.path[1:]) if len(parts.path) > 1 else "/"

    async def _session(self, conn: aiormq.abc.AbstractConnection) -> None:
        raise NotImplementedError

    async def _local(self, vhost: str) -> None:
        """The session with an upstream on this broker (``broker/federation/local.py``)."""
        up = self.vhosts.get(vhost)
        if up is None:
            raise RuntimeError(f"no vhost '{vhost}' here")
        self.upstream_cluster, self.upstream_vhost = self.cluster_name, vhost
        await self._local_session(up)
        self._set("error", "the link stopped")

    async def _local_session(self, up: VHost) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------ messages
    @staticmethod
    def hops_of(props: Any) -> list[Any]:
        """The ``x-received-from`` list of a message's properties (pamqp's), this hop not yet added."""
        headers = props.headers if isinstance(props.headers, dict) else {}
        hops = headers.get("x-received-from")
        return list(hops) if isinstance(hops, list) else []

    def forward(self, body: bytes, redelivered: bool, exchange: str, routing_key: str, props: Any,
                hops: list[Any], where: tuple[str, str], settle: Callable[[bool], None]) -> None:
        """Publish one delivery here with this hop added; ``settle(ok)`` tells the upstream (by
        ack-mode: at once, or once the copy here is durable)."""
        hop = {"uri": self.uri, where[0]: where[1], "redelivered": bool(redelivered),
               "cluster-name": self.upstream_cluster, "vhost": self.upstream_vhost}
        hops = [*hops, hop][-MAX_RECEIVED_FROM:]
        headers = dict(props.headers) if isinstance(props.headers, dict) else {}
        headers["x-received-from"] = hops
        props.headers = headers
        try:
            raw = bytes(commands.Basic.Properties.marshal(props))
            now = int(time.time() * 1000)
            out = self.vhost.publish(PublishRequest(exchange, routing_key, raw, body, now))
        except (errors.AMQPError, errors.DiskFull, OSError) as exc:
            settle(False)
            raise Refused(f"this broker refused a message: {exc}") from None
        if out.rejected:
            settle(False)
            raise Refused("this broker refused a message (a queue is full)")
        if self.upstream.ack_mode == "on-confirm" and out.sync:
            deps = None if out.held else [q.store for q in out.queues]
            self.after_sync(settle, deps)
        else:
            settle(True)

    def settler(self, channel: aiormq.abc.AbstractChannel, msg: DeliveredMessage) -> Callable[[bool], None]:
        tag, mode = msg.delivery_tag, self.upstream.ack_mode
        return lambda ok: self._settle(channel, tag, ok, mode)

    def _settle(self, channel: aiormq.abc.AbstractChannel, tag: int | None, ok: bool, mode: str) -> None:
        if mode == "no-ack" or tag is None or channel.is_closed:
            return  # a closed channel: the upstream requeues what it had not been told
        coro = channel.basic_ack(tag) if ok else channel.basic_nack(tag, requeue=True)
        task = asyncio.ensure_future(coro)
        task.add_done_callback(_quiet)

    # ------------------------------------------------------------ status
    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "node": self.node, "vhost": self.vhost.name,
            "id": f"{self.kind}:{self.resource}:{self.upstream.name}",
            "type": self.kind, "upstream": self.upstream.name, "uri": self.uri, "status": self.status,
            "timestamp": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since)),
            self.kind: self.resource,
            f"upstream_{self.kind}": self.upstream_name(),
        }
        if self.error is not None:
            out["error"] = self.error
        return out

    def upstream_name(self) -> str:
        raise NotImplementedError


def _quiet(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # a closed channel: the session ends and the link reconnects


def _reason(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return "the upstream did not answer in time"
    if isinstance(exc, aiormq.exceptions.ChannelClosed) and len(exc.args) >= 2:
        return f"channel closed by the upstream: {exc.args[0]} {exc.args[1]}"
    if isinstance(exc, ConnectionError | OSError):
        return f"cannot connect to the upstream: {exc}"
    text = str(exc) or type(exc).__name__
    return text if len(text) < 500 else text[:500] + "..."
