"""A client on the cluster leader's own ports, for a vhost another node serves (``shard_servers``).

Theory of operation
-------------------
A client never sees which node serves its vhost: a follower's proxy routes each AMQP connection
by the vhost its ``connection.open`` names (``vhost_route.py``), and the cluster leader's own
ports must do the same, though there the broker itself reads the handshake. Each front end reads
its protocol's handshake as far as the vhost, as it does for another worker of the node
(``broker.aio.give_away``); when the vhost is one this broker does not hold but the election
says another node serves (``elsewhere``) it hands the connection over with what it read, and
``hand_over`` carries it on a tunnel to that node's replication port, to its listener of the
same protocol (``SpliceProxy.adopt``), where the login is checked again, with that node's users
and permissions, before anything is opened:

* AMQP: the session authenticated the client and checked the vhost; at ``open`` it hands over
  with the client's ``start-ok`` (``replays_login``). The handshake is rebuilt from it
  (``Opened``: that start-ok, a ``tune-ok`` with the limits negotiated here, the ``open``, the
  bytes read after it) and replayed (``vhost_router.replay``); the node answers ``open-ok``
  (or its refusal). A client of our AMQPS port takes its TLS along (TLS ends here): the verified
  certificate goes in the tunnel's hello (``broker.tls.carried``, PROXY v2's SSL TLV; only a
  member with the cluster secret opens a tunnel), so that node offers EXTERNAL and derives the
  user from it by its own ``tls_cert_login_from``, as if the client had reached it directly.
* MQTT: the CONNECT names the vhost (``vhost:user``, or the listener's default) and carries
  the credentials itself; the connection is handed over before the login, with every byte read
  (``rest``: the CONNECT and anything after it), and those bytes are the whole replay: the
  node's MQTT listener reads the CONNECT as from a client of its own and answers the CONNACK
  (a refusal included: bad user name or password, not authorized).
* The stream protocol: ``Open`` names the vhost after the login; the leader played the login
  and hands over with the client's login frames (``login``) and the ``Open`` with what followed
  (``rest``); ``stream_route.StreamReplay`` plays them to the node, whose ``SaslAuthenticate``
  response decides, then its ``Open`` response reaches the client.

A serving node that cannot be reached or does not answer within the handshake's bound gets the
client its protocol's refusal: AMQP 320, an MQTT CONNACK "server unavailable", a stream ``Open``
response ``VHOST_ACCESS_FAILURE``. The credentials stay in memory only until the connection is
carried.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import socket
from collections.abc import Awaitable, Callable, Collection
from typing import Any

from pamqp import commands, frame

from broker import errors, tls
from broker.cluster import codec, stream_route, unavailable
from broker.cluster.proxy import Carried, Play, SpliceProxy, Target
from broker.cluster.stream_route import StreamReplay
from broker.cluster.vhost_route import Failed, Opened, refusal
from broker.cluster.vhost_router import replay

log = logging.getLogger(__name__)

Streams = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class Elsewhere:
    """``broker.amqp.broker.Shards`` (and ``broker.aio.Router`` for MQTT and the stream protocol)
    for the cluster leader's broker: ``served_elsewhere(vhost)`` says another node serves it;
    ``carrier`` (a routed, tunnelling ``SpliceProxy``) carries it."""

    replays_login = True

    def __init__(self, served_elsewhere: Callable[[str], bool], carrier: SpliceProxy,
                 closed: Collection[str] = (), members: Callable[[], dict[str, Target]] = dict) -> None:
        self.served_elsewhere = served_elsewhere
        self.carrier = carrier
        self.closed = closed  # the vhosts closed here: served elsewhere, or moving there
        self.members = members  # every other live member's replication port, by node id

    def moving(self, vhost: str) -> bool:
        """Closed here, its next server not known here yet."""
        return vhost in self.closed and not self.served_elsewhere(vhost)

    def elsewhere(self, vhost: str) -> bool:
        """Another node serves ``vhost``; ``errors.NotAllowed`` while it moves there (closed
        here, its server not known yet), which a front end answers as for a worker that
        restarts: MQTT "server unavailable", the stream ``VHOST_ACCESS_FAILURE`` (AMQP: 530), so
        a client retries rather than hear that its credentials were wrong."""
        if self.served_elsewhere(vhost):
            return True
        if self.moving(vhost):
            raise errors.NotAllowed(f"vhost '{vhost}' is moving to another node: retry")
        return False

    def server_of(self, vhost: str) -> str | None:
        """The node serving ``vhost`` when another one does (its replication address), None when
        served here (``errors.NotAllowed`` while it moves)."""
        if not self.elsewhere(vhost):
            return None
        assert self.carrier.routed is not None
        target = self.carrier.routed.serving(vhost)
        return f"{target.host}:{target.port}"

    async def open_http(self, vhost: str, client: tuple[str, int], which: int = codec.HTTP_PORT
                        ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        """A connection to the management API (``which``: or the metrics port) of the node
        serving ``vhost`` for ``client`` (``broker.http.forward``): one end of a socket pair, the
        other carried there; None when ``vhost`` is not served elsewhere (``errors.NotAllowed``
        while it moves)."""
        if not self.elsewhere(vhost):
            return None
        return await self._open(Carried(vhost, which, _sends(b""), unavailable.http_response), client)

    async def open_members(self, client: tuple[str, int]) -> list[tuple[str, Streams]]:
        """A connection to the management API of every other live member (its shard broker's,
        which answers for that member: ``GET /api/nodes``), by node id; a member serving no
        shard has no shard broker: its connection is answered 503 (``unavailable.http_response``)."""
        def carried(target: Target) -> Carried:
            return Carried("", codec.HTTP_PORT, _sends(b""), unavailable.http_response, to=target)

        return [(node_id, await self._open(carried(target), client))
                for node_id, target in sorted(self.members().items())]

    async def _open(self, carried: Carried, client: tuple[str, int]) -> Streams:
        """One end of a socket pair whose other end is carried (``carried``) for ``client``."""
        if not _is_ip(client[0]):
            client = (codec.UNIX_CLIENT, 0)  # a Unix socket's client: local there too
        ours, theirs = socket.socketpair()
        theirs.setblocking(False)
        self.carrier.adopt(theirs, client, carried)
        return await asyncio.open_connection(sock=ours)

    async def open_nodes(self, client: tuple[str, int], metrics: bool = False) -> tuple[
            list[tuple[str, tuple[asyncio.StreamReader, asyncio.StreamWriter]]], list[str]]:
        """A connection to the management API of each other node serving a vhost (the parts of
        a node-wide answer, ``broker.http.forward``; to its metrics port for the cluster leader's
        metrics port, which has no login to pass on), each named by the vhosts it serves; and
        the vhosts moving (closed here, their next server not known yet), whose part nobody
        can give now."""
        assert self.carrier.routed is not None
        serving = self.carrier.routed.serving
        by_node: dict[tuple[str | None, int], list[str]] = {}
        moving: list[str] = []
        for vhost in sorted(self.closed):
            if self.served_elsewhere(vhost):
                target = serving(vhost)
                by_node.setdefault((target.host, target.port), []).append(vhost)
            else:
                moving.append(vhost)
        opened = []
        for vhosts in by_node.values():
            which = codec.METRICS_PORT if metrics else codec.HTTP_PORT
            streams = await self.open_http(vhosts[0], client, which)
            if streams is not None:
                opened.append((", ".join(repr(v) for v in vhosts), streams))
        return opened, moving

    def hand_over(self, fd: int, state: dict[str, Any]) -> None:
        vhost = str(state["vhost"])
        protocol = state.get("protocol", "amqp")
        if protocol == "mqtt":
            carried = _mqtt(vhost, bytes(state.get("rest", b"")))
        elif protocol == "stream":
            carried = _stream(vhost, state)
        elif protocol == "amqp":
            carried = _amqp(vhost, state)
        else:
            raise ValueError(f"no carrier for {protocol!r} connections to another node")
        peer = state.get("peer")
        client = (str(peer[0]), int(peer[1])) if isinstance(peer, tuple | list) and len(peer) >= 2 \
            else ("127.0.0.1", 0)
        if state.get("unix"):
            client = (codec.UNIX_CLIENT, 0)  # the node takes it as a local client, as we did
        sock = socket.socket(fileno=os.dup(fd))
        sock.setblocking(False)
        log.debug("%s connection from %s:%d for vhost %r: carried to the node serving it", protocol, *client,
                  vhost)
        self.carrier.adopt(sock, client, carried)


def _amqp(vhost: str, state: dict[str, Any]) -> Carried:
    login = bytes(state.get("login", b""))
    if not login:  # a connection with no start-ok to replay (never so for AMQP)
        raise ValueError("no login to replay on the vhost's node")
    channel_max, frame_max = int(state["channel_max"]), int(state["frame_max"])
    tune_ok = commands.Connection.TuneOk(channel_max=channel_max, frame_max=frame_max,
                                         heartbeat=int(state["heartbeat"]))
    opened = Opened(vhost, login, frame.marshal(tune_ok, 0),
                    frame.marshal(commands.Connection.Open(virtual_host=vhost), 0),
                    bytes(state.get("rest", b"")), channel_max, frame_max)
    peer = state.get("tls")  # the TLS we ended: that node's EXTERNAL reads its certificate
    peer_tls = tls.carried(peer) if isinstance(peer, tls.PeerTLS) else b""
    return Carried(vhost, codec.AMQP_PORT, lambda read, write: replay(opened, read, write), refusal,
                   peer_tls)


def _sends(data: bytes) -> Play:
    """A replay that is ``data`` as it came (the serving node reads and checks it itself)."""
    async def play(_read: Callable[[], Awaitable[bytes]], write: Callable[[bytes], None]) -> bytes:
        if data:
            write(data)
        return b""

    return play


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _mqtt(vhost: str, rest: bytes) -> Carried:
    def refuse(_why: str) -> bytes:
        return unavailable.mqtt_connack(rest) or b""

    return Carried(vhost, codec.MQTT_PORT, _sends(rest), refuse)  # the CONNECT: the node logs it in


def _stream(vhost: str, state: dict[str, Any]) -> Carried:
    login, rest = bytes(state.get("login", b"")), bytes(state.get("rest", b""))
    if not login:
        raise ValueError("no login to replay on the vhost's node")
    frame_max = int(state.get("frame_max", 0))

    async def play(read: Callable[[], Awaitable[bytes]], write: Callable[[bytes], None]) -> bytes:
        rep = StreamReplay(login, rest, frame_max)
        write(rep.start())
        while not rep.spliced:
            data = await read()
            if not data:
                raise Failed("the vhost's node closed during the handshake", stream_route.refusal(rest))
            if out := rep.receive(data):
                write(out)
        return rep.to_client

    return Carried(vhost, codec.STREAM_PORT, play, lambda _why: stream_route.refusal(rest))
