"""One federation link: a connection to an upstream broker that moves messages into this one.

Theory of operation
-------------------
A link runs as one asyncio task on the node that serves (a cluster's leader: followers run no
broker, so no links; a new leader's broker starts them again from the parameters and policies it
replicated). The task connects to the upstream (each URI of the upstream in turn) on the shared link layer's
connection (``broker/links/wire.py``: deliveries read in place off whole socket reads), sets up
what the link kind needs there (``ExchangeLink``, ``QueueLink``), then consumes with a prefetch
of ``prefetch-count`` and hands every delivery to ``forward``, which publishes it here through
the link layer's ``TurnPublisher`` (``broker/links/turn.py``: a turn's deliveries through the
model's batch operation ``VHost.publish_batch``, one group-commit wait per turn, not one per
message) and settles it upstream by ``ack-mode``, with coalesced ``multiple`` acks
(``broker/links/acks.py``):

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

from pamqp import commands
from pamqp.base import Frame as PFrame

from broker.federation.upstream import Upstream, local_vhost, scrub
from broker.links.acks import Acker
from broker.links.message import EndLost, Message, Verdict
from broker.links.turn import AfterSync, TurnPublisher
from broker.links.wire import Wire, open_first
from broker.model.vhost import VHost

__all__ = ["CALL_TIMEOUT", "AfterSync", "Link", "Refused", "UpstreamWire"]

log = logging.getLogger(__name__)

MAX_BACKOFF_FACTOR = 16  # reconnect-delay doubles per failure in a row up to this many times
CALL_TIMEOUT = 10.0  # seconds for the upstream to answer a declare, bind, consume or cancel
MAX_RECEIVED_FROM = 64  # entries kept in x-received-from: a bound on what a peer can grow


class UpstreamWire(Wire):
    role = "upstream"

    async def ask(self, channel: int, method: PFrame, answer: type[PFrame]) -> PFrame:
        """``call`` within ``CALL_TIMEOUT``: a mute upstream ends the session."""
        async with asyncio.timeout(CALL_TIMEOUT):
            return await self.call(channel, method, answer)


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
        self._wire: UpstreamWire | None = None
        self.acker: Acker | None = None  # settles the session's deliveries upstream
        self.turn = TurnPublisher(self._live_vhost, after_sync, upstream.ack_mode == "on-confirm",
                                  lambda why: self.fail(Refused(f"this broker refused a message: {why}")))
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

    def _live_vhost(self) -> VHost | None:
        return None if self.vhosts.get(self.vhost.name) is not self.vhost else self.vhost

    async def _close(self) -> None:
        wire, self._wire = self._wire, None
        if self.acker is not None:
            self.acker.close()  # what was settled is acked before the connection goes
            self.acker = None
        if wire is not None:
            wire.on_message = wire.track = None
            await wire.shutdown("federation link closing")

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
        if self._wire is not None:  # an in-process link has no connection
            waits.append(self._wire.lost)
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        if self._failed.done():
            self._failed.result()
        if self._wire is not None and self._wire.lost.done():
            raise EndLost(self._wire.lost.result())

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
                        wire = await self._connect(uri)
                        await self._session(wire)
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

    async def _connect(self, uri: str) -> UpstreamWire:
        name = f"Federation link (upstream: {self.upstream.name}, {self.kind}: {self.resource})"
        try:
            wire, _ = await open_first([uri], {"connection_name": name, "product": "Skred federation"},
                                       UpstreamWire)
        except EndLost as exc:  # refused, TLS, wrong credentials, no answer: the reason names it
            raise EndLost(f"cannot connect to the upstream: {exc}") from None
        self._wire = wire
        cluster = wire.server_properties.get("cluster_name")
        parts = urlsplit(uri)
        self.upstream_cluster = (cluster.decode() if isinstance(cluster, bytes) else str(cluster)) \
            if cluster else f"{parts.hostname}:{parts.port or 5672}"
        self.upstream_vhost = unquote(parts.path[1:]) if len(parts.path) > 1 else "/"
        return wire

    async def _session(self, wire: UpstreamWire) -> None:
        raise NotImplementedError

    async def consume(self, wire: UpstreamWire, channel: int, queue: str,
                      on_message: Callable[[Message], None]) -> str:
        """Start the upstream consumer on ``channel`` (deliveries to ``on_message``, settled by
        ``self.acker``): its consumer tag."""
        no_ack = self.upstream.ack_mode == "no-ack"
        wire.channel, wire.on_message, wire.consuming = channel, on_message, True
        if not no_ack and self.acker is None:
            self.acker = Acker(wire, self.upstream.prefetch_count)
        consume = commands.Basic.Consume(queue=queue, consumer_tag=self.upstream.consumer_tag or "",
                                         no_ack=no_ack)
        ok = await wire.ask(channel, consume, commands.Basic.ConsumeOk)
        assert isinstance(ok, commands.Basic.ConsumeOk)
        return str(ok.consumer_tag)

    async def qos(self, wire: UpstreamWire, channel: int) -> None:
        qos = commands.Basic.Qos(prefetch_count=self.upstream.prefetch_count)
        await wire.ask(channel, qos, commands.Basic.QosOk)

    def remote_settler(self, msg: Message) -> Callable[[bool], None]:
        acker, tag = self.acker, msg.tag
        if acker is None:  # no-ack
            return _nothing
        return lambda ok: acker.settle(tag, ok)

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
    def hops_of(msg: Message) -> list[Any]:
        """The ``x-received-from`` list of a message, this hop not yet added."""
        headers = msg.props.headers
        hops = headers.get("x-received-from") if isinstance(headers, dict) else None
        return list(hops) if isinstance(hops, list) else []

    def forward(self, msg: Message, exchange: str, routing_key: str, hops: list[Any], where: tuple[str, str],
                settle: Callable[[bool], None]) -> None:
        """Publish one delivery here with this hop added (in this turn's batch); ``settle(ok)``
        tells the upstream (by ack-mode: once published, or once the copy here is durable). A
        message this broker refuses is given back upstream and ends the session."""
        hop = {"uri": self.uri, where[0]: where[1], "redelivered": bool(msg.redelivered),
               "cluster-name": self.upstream_cluster, "vhost": self.upstream_vhost}
        props = msg.props
        headers = dict(props.headers) if isinstance(props.headers, dict) else {}
        headers["x-received-from"] = [*hops, hop][-MAX_RECEIVED_FROM:]  # type: ignore[assignment]
        props.headers = headers
        msg.exchange, msg.routing_key = exchange, routing_key

        def published(verdict: Verdict) -> None:
            settle(verdict is Verdict.OK)
            if verdict is not Verdict.OK:
                self.fail(Refused(f"this broker refused a message: {self.turn.problem or 'a queue is full'}"))

        self.turn.add(msg, published)

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


def _nothing(_ok: bool) -> None:
    """Settling a ``no-ack`` delivery: the upstream forgot it as it sent it."""


def _reason(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return "the upstream did not answer in time"
    if isinstance(exc, EndLost):
        return str(exc)
    if isinstance(exc, ConnectionError | OSError):
        return f"cannot connect to the upstream: {exc}"
    text = str(exc) or type(exc).__name__
    return text if len(text) < 500 else text[:500] + "..."
