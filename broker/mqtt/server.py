"""The MQTT listener: an asyncio Protocol that moves bytes between a socket and an ``MQTTSession``.

Theory of operation
-------------------
Bytes go to the sans-IO parser (``packets.Parser``); packets to the session. The first packet must
be CONNECT, within ``connect_timeout`` seconds of the connection (a silent socket is closed). Its
credentials are checked asynchronously (the login throttle may make it wait); packets that arrive
meanwhile wait in a short list (at most ``_PENDING_MAX``: a client that floods before its CONNACK
is closed). Reading stops while the socket's write buffer is full (``pause_writing``), and the
session's consumers have no capacity then, so a slow reader holds neither its input nor its
deliveries in memory beyond one buffer. Keepalive: a client silent for 1.5 times its keepalive is
closed (MQTT 3.1.1 section 3.1.2.10) and its will published. A protocol violation or a bug closes
that one connection; the broker goes on.

Each open connection is also what the management API and the metrics read of it
(``views.ConnectionView``: protocol, client id, user, vhost, peer, byte and packet counts) and
what ``DELETE /api/connections/{name}`` closes (MQTT 5 hears DISCONNECT 0x98, administrative
action); ``MQTTServer`` is the ``views.FrontEndView`` the node adds to the management state.

On a node of several workers (``broker/shards``) every worker listens on the MQTT port and a
connection belongs to the worker that owns its vhost. The vhost is known once CONNECT is parsed
(``vhost:user``, or ``[mqtt] vhost``) and nothing has been answered yet, so the hand-over needs no
session state: the bytes read so far (``first``) go with the socket (``broker.aio.give_away``),
and the owner's ``MQTTServer.resume`` reads them again as if its own listener had accepted the
connection. It checks the credentials and answers CONNACK; the client never sees the move. While
the owner restarts, CONNACK says server unavailable.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import ssl
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, cast

from broker import errors
from broker.aio import Listeners, Relay, Router, hand_off, take_over
from broker.auth.throttle import TooManyFailures, check_login
from broker.auth.users import UNIX_PEER, UserStore
from broker.config import MqttConfig
from broker.errors import AMQPError
from broker.model.queue import Queue
from broker.model.vhost import VHost
from broker.mqtt import overview
from broker.mqtt import packets as P
from broker.mqtt import props as PR
from broker.mqtt.durable import Key, PendingWill, SessionState, SessionStates
from broker.mqtt.hold import PublisherHold
from broker.mqtt.mapping import key_fits
from broker.mqtt.retained import FilesOf, Retained
from broker.mqtt.session import (
    VERSIONS,
    AfterSync,
    MQTTConsumer,
    MQTTSession,
    Registry,
    Settings,
    runnable,
    split_username,
)
from broker.mqtt.wills import arm_will
from broker.tls import PeerTLS
from broker.views import SessionEntry

log = logging.getLogger(__name__)

_PENDING_MAX = 64  # packets a client may send before its CONNACK
RC_MAXIMUM_CONNECT_TIME = 0xA0  # MQTT 5's DISCONNECT reason for an expired credential (RabbitMQ's)
UNAUTHENTICATED_MAX_PACKET = 256 * 1024  # bytes of one packet before the login succeeded
Peer = tuple[str, int]
# QoS 0 PUBLISHes taken as one run at most: the store writes a run at once, and a longer one
# would hold the loop for one publisher
RUN_MAX = 256
_PUBACK_FIRST = 0x40  # a PUBACK's first octet (its remaining length is 2 in the 3.1.1 form)
OUT_BATCH = 64 * 1024  # bytes of output gathered before they are written within a loop turn


class MQTTProtocol(asyncio.Protocol):
    def __init__(self, server: MQTTServer, unix: bool = False, websocket: bool = False) -> None:
        self.server = server
        self.unix = unix  # on the Unix socket: the peer is UNIX_PEER
        self.websocket = websocket  # over WebSocket on the management port
        cfg = server.config
        # before its CONNACK a client may send little: a CONNECT with its will, and a few packets
        self.parser = P.Parser(min(cfg.max_packet_size, UNAUTHENTICATED_MAX_PACKET))
        self.transport: asyncio.Transport | None = None
        self.peer_host = ""
        self.out: list[bytes] = []  # written by flush, once per loop turn or OUT_BATCH bytes
        self.out_size = 0
        self.session: MQTTSession | None = None
        self.state = "new"  # new -> login -> open -> closed
        self.pending: list[P.Packet] = []
        self.writable = True
        self.held = False  # reading stopped by the publisher hold (``hold.py``)
        self.stash = b""  # the read it holds (one socket read at most)
        self.rest: list[P.Packet] = []  # a read's packets left for the next loop turn
        self.feeds: set[Queue] = set()  # the queues this client's last publishing read reached
        self.last_publishes = 0  # the PUBLISHes in that read
        self.last_seen = time.monotonic()
        self.keepalive = 0.0
        self.timer: asyncio.TimerHandle | None = None
        self.expiry: asyncio.TimerHandle | None = None  # when the login's access token expires
        self.level = 4  # the CONNECT's protocol level, once it came
        self.connected_at = time.time()
        self.recv_cnt = self.recv_oct = self.send_cnt = self.send_oct = 0
        self.tls: PeerTLS | None = None
        self.peer_port = 0
        self.remapped = True  # the peer is final (False: a follower's tunnel may name another)
        # every byte read before CONNECT is handled, on a node of several workers (hand-over)
        self.first: bytearray | None = bytearray() if server.router is not None else None
        self.relay: Relay | None = None  # handed over to another worker, through us (TLS, WebSocket)

    # ------------------------------------------------------------------ views.ConnectionView
    @property
    def name(self) -> str:
        return self.client_id  # what DELETE /api/connections/{name} also takes

    @property
    def peer(self) -> tuple[str, int]:
        return self.peer_host, self.peer_port

    @property
    def client_id(self) -> str:
        return self.session.client_id if self.session is not None else ""

    @property
    def protocol(self) -> str:
        return ("Web MQTT " if self.websocket else "MQTT ") + VERSIONS.get(self.level, ("?", ""))[0]

    @property
    def listener(self) -> str:
        if self.websocket:
            return "http"
        return "mqtt/ssl" if self.tls is not None else "mqtt"

    @property
    def vhost(self) -> str:
        s = self.session
        return s.vhost.name if s is not None and s.vhost is not None else ""

    @property
    def username(self) -> str:
        s = self.session
        return s.user.name if s is not None and s.user is not None else ""

    @property
    def chs(self) -> Mapping[int, Any]:
        return {}  # MQTT has no channels

    channel_max = 0
    auth_mechanism = "PLAIN"

    @property
    def frame_max(self) -> int:
        return self.parser.max_packet

    @property
    def heartbeat(self) -> int:
        return int(self.keepalive / 1.5)

    @property
    def client_properties(self) -> dict[str, Any]:
        return {"client_id": self.client_id, "protocol_level": self.level}

    def close_connection(self, error: AMQPError) -> None:
        """The management API closes the connection: MQTT 5 hears why (administrative action)."""
        if self.state == "closed":
            return
        log.warning("MQTT client '%s' from %s: closing: %s", self.client_id, self.peer_host, error.reply_text)
        self.abort(P.RC_ADMINISTRATIVE_ACTION)

    def wakeup(self) -> None:
        pass  # its writes go out once per loop turn (flush)

    # ------------------------------------------------------------------ Output
    # What a connection sends in one loop turn is gathered and written once: a transport write is
    # a system call, and one per delivered message held a subscriber to about a thousand
    # messages a second on a loaded machine (benchmarks/mqtt.py). Every OUT_BATCH bytes go at
    # once, so a long burst of publishes in one read still streams to its subscribers.
    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            if not self.out:
                asyncio.get_running_loop().call_soon(self.flush)
            self.send_cnt += 1
            self.send_oct += len(data)
            self.out.append(data)
            self.out_size += len(data)
            if self.out_size >= OUT_BATCH:
                self.flush()

    def flush(self) -> None:
        out, self.out, self.out_size = self.out, [], 0
        if out and self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"".join(out))

    def close(self) -> None:
        if self.transport is not None:
            self.flush()
            self.transport.close()

    # ------------------------------------------------------------------ asyncio
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass
        info = transport.get_extra_info("peername")
        if self.unix:
            self.peer_host = UNIX_PEER
        elif info:
            self.peer_host, self.peer_port = str(info[0]), int(info[1])
            self.remapped = False
        self.tls = PeerTLS.of(transport.get_extra_info("ssl_object"))
        self.server.connections.add(self)
        self._arm(self.server.config.connect_timeout)

    def data_received(self, data: bytes) -> None:
        if self.relay is not None:
            self.relay.to_owner(data)
            return
        if self.first is not None:
            self.first += data
        if not self.remapped:
            # a follower's tunnel names its client before it sends the first byte (not before
            # the connection is accepted): the client's address is looked up now
            self.remapped = True
            self.peer_host, self.peer_port = self.server.peers.get(self.peer, self.peer)
        self.last_seen = time.monotonic()
        self.recv_oct += len(data)
        if data and data[0] == _PUBACK_FIRST and not self.feeds and self.state == "open" \
                and self._pubacks(data):
            return
        wait = None if self.held else self._must_wait()
        if self.held or wait:
            # the publisher hold (hold.py): this read waits, whole, until its queues have room
            self.stash += data
            if wait and self.transport is not None:
                self.held = True
                self.transport.pause_reading()
                self.server.hold.hold(self, wait, self.last_publishes)
            return
        self._read(data)

    def _pubacks(self, data: bytes) -> bool:
        """A read of nothing but whole 3.1.1-form PUBACKs (a subscriber acknowledging its QoS 1
        deliveries, the most frequent read of a fan-out) settled without the parser: True when
        it was that and they were handled; False (nothing done) for anything else."""
        n = len(data)
        if n & 3 or self.held or self.rest or self.parser.buf or self.parser.error is not None:
            return False
        if n == 4:
            if data[1] != 2:
                return False
            pids = [data[2] << 8 | data[3]]
        else:
            k = n >> 2
            if data[::4].count(_PUBACK_FIRST) != k or data[1::4].count(2) != k:
                return False
            pids = [data[i] << 8 | data[i + 1] for i in range(2, n, 4)]
        session = self.session
        assert session is not None
        self.recv_cnt += len(pids)
        self._guarded(lambda: session.pubacks(pids))
        return True

    def _must_wait(self) -> list[Queue] | None:
        """The queues this publisher fed last when one has too many ready for its consumers
        (those this same connection consumes from left out: its acks are what drains them)."""
        s = self.session
        if not self.feeds or s is None or self.state != "open":
            return None
        own = {c.queue for c in s.consumers.values()}
        fed = [q for q in self.feeds if q not in own]
        return fed if self.server.hold.backlogged(fed) else None

    def _read(self, data: bytes, budget: bool = True) -> None:
        packets = self.parser.feed(data) if data else []
        if self.rest:
            packets, self.rest = self.rest + packets, []
        hold = self.server.hold
        publishes = 0
        i, n = 0, len(packets)
        while i < n:
            if self.state == "closed":
                return
            p = packets[i]
            if isinstance(p, P.Publish):
                if budget and hold.turn_full() and self.transport is not None:
                    self.rest = packets[i:]  # the next loop turn takes them (hold.py)
                    self.held = True
                    self.transport.pause_reading()
                    hold.wait_turn(self)
                    break
                if self.state == "open":
                    k = self._run(packets, i, n)
                else:  # (before the CONNACK: kept for after it, one by one)
                    k = 1
                    self._packet(p)
                publishes += k
                hold.count(k)
                self.recv_cnt += k
                i += k
                continue
            self.recv_cnt += 1
            self._packet(p)
            i += 1
        s = self.session
        if s is not None and s.fed:
            self.feeds, s.fed = s.fed, set()
            self.last_publishes = publishes
        if self.parser.error is not None and self.state != "closed" and not self.rest:
            log.warning("MQTT connection from %s: protocol violation: %s: closing", self.peer_host,
                        self.parser.error)
            self.abort(self.parser.error.code)

    def read_again(self) -> None:
        """The publisher hold lets this connection go: what it held is taken now."""
        self.held = False
        wait = self._must_wait() if self.stash or self.rest else None
        if wait and self.transport is not None:  # its queues filled up meanwhile: it waits for them
            self.held = True
            self.server.hold.hold(self, wait, self.last_publishes)
            return
        data, self.stash = self.stash, b""
        if (data or self.rest) and self.state != "closed":
            self._read(data)
        if not self.held and self.writable and self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    def _run(self, packets: list[P.Packet], i: int, n: int) -> int:
        """The PUBLISH at ``packets[i]`` and, when it starts a run (QoS 0 or 1 to one topic,
        ``runnable``), the ones after it that the publish operation takes at once: how many
        were handled. A run is at most ``RUN_MAX`` long and never more than the loop turn's
        publish budget has left; what the operation does not take goes one by one."""
        p = packets[i]
        j = i + 1
        if runnable(p):
            assert isinstance(p, P.Publish)
            end = min(n, i + min(RUN_MAX, max(1, self.server.hold.turn_left())))
            topic, qos = p.topic, p.qos
            while j < end and runnable(q := packets[j]) and cast(P.Publish, q).topic == topic \
                    and cast(P.Publish, q).qos == qos:
                j += 1
        if j - i == 1:
            self._packet(p)
            return 1
        run = cast(list[P.Publish], packets[i:j])
        session = self.session
        assert session is not None
        if not self._guarded(lambda: session.publish_run(run)):
            for q in run:  # one by one: each answered, or the connection closed, on its own
                if self.state == "closed":
                    break
                self._packet(q)
        return j - i

    def _guarded(self, call: Callable[[], bool | None]) -> bool:
        """``call`` (the session handling packets): a protocol violation or a bug closes this
        connection, never the broker. True when it returned True."""
        assert self.session is not None
        try:
            return call() is True
        except P.MalformedPacket as exc:
            log.warning("MQTT client '%s' from %s: protocol violation: %s: closing",
                        self.session.client_id, self.peer_host, exc)
            self.abort(exc.code)
        except Exception:  # a bug must cost one connection, never the broker
            log.exception("internal error on MQTT connection from %s", self.peer_host)
            self.abort(P.RC_IMPLEMENTATION_SPECIFIC)
        return True  # handled: the connection is closed

    def _packet(self, p: P.Packet) -> None:
        if self.state == "open":
            session = self.session
            assert session is not None
            self._guarded(lambda: session.handle(p))
        elif self.state == "new":
            if not isinstance(p, P.Connect):
                log.warning("MQTT connection from %s: first packet is not CONNECT: closing", self.peer_host)
                self.abort()
                return
            if p.will is not None and not key_fits(p.will.topic):
                log.warning("MQTT connection from %s: a will topic of %d bytes: refused", self.peer_host,
                            len(p.will.topic.encode()))
                if p.level == 5:
                    self.write(P.encode_connack(False, P.RC_TOPIC_NAME_INVALID, None, True))
                self.abort()  # 3.1.1 has no CONNACK code for it: the connection closes
                return
            if self._handed_over(p):
                return
            self.state = "login"
            self.level = p.level
            self._arm(0)  # the CONNECT came in time; the login throttle bounds its own wait
            self.server.spawn(self._login(p))
        elif self.state == "login":
            if len(self.pending) >= _PENDING_MAX:
                log.warning("MQTT connection from %s: %d packets before CONNACK: closing", self.peer_host,
                            len(self.pending))
                self.abort()
                return
            self.pending.append(p)

    def _handed_over(self, c: P.Connect) -> bool:
        """Give the connection to the worker that owns its vhost (see the module doc): True when
        it is no longer ours (handed over, relayed, or refused because that worker restarts)."""
        first, self.first = self.first, None
        router, t = self.server.router, self.transport
        if router is None or first is None or c.username is None or t is None:
            return False
        vhost = split_username(c.username, self.server.config.vhost)[0]
        try:
            if not router.elsewhere(vhost):
                return False
        except errors.NotAllowed as exc:
            log.warning("MQTT connection from %s: %s", self.peer_host, exc.reply_text)
            v5 = c.level == 5
            code = P.RC_SERVER_UNAVAILABLE if v5 else P.SERVER_UNAVAILABLE
            self.write(P.encode_connack(False, code, None, v5))
            self.abort()
            return True
        state = {"protocol": "mqtt", "vhost": vhost, "peer": self.peer, "unix": self.unix,
                 "websocket": self.websocket, "tls": self.tls, "rest": bytes(first)}
        self.state = "closed"
        self._arm(0)
        self.server.connections.discard(self)
        self.relay = hand_off(t, router, state, f"MQTT connection from {self.peer_host} ({self.listener})")
        return True

    async def _login(self, c: P.Connect) -> None:
        srv = self.server
        v5 = c.level == 5
        code = self._refusal(c)
        user = vh = None
        if code == P.ACCEPTED:
            assert c.username is not None
            vhost_name, name = split_username(c.username, srv.config.vhost)
            password = (c.password or b"").decode("utf-8", errors="replace")
            try:
                user = await check_login(srv.users, name, password, self.peer_host, "MQTT")
            except TooManyFailures:
                code = P.RC_SERVER_UNAVAILABLE if v5 else P.SERVER_UNAVAILABLE
            else:
                vh = srv.vhosts.get(vhost_name)
                if user is None:
                    code = P.RC_BAD_CREDENTIALS if v5 else P.BAD_CREDENTIALS
                elif vh is None or not srv.users.has_vhost_access(user, vhost_name):
                    log.warning("MQTT client from %s: user '%s' has no access to vhost '%s'", self.peer_host,
                                name, vhost_name)
                    code = P.RC_NOT_AUTHORIZED if v5 else P.NOT_AUTHORIZED
        if self.state != "login":
            return  # the socket went while the login waited
        if code != P.ACCEPTED or user is None or vh is None:
            self.write(P.encode_connack(False, code, None, v5))
            self.abort()
            return
        session = self.session = MQTTSession(srv.vhosts, srv.users, srv.settings, srv.after_sync,
                                             srv.registry, self, self.peer_host)
        try:
            must_sync = session.begin(c, user, vh)
            if session.will_unsaved or must_sync and not await self._synced(vh.name):
                log.warning("MQTT client '%s' from %s: its will could not be made durable: refused",
                            session.client_id, self.peer_host)
                session.will = None  # refused: the CONNECT (its will) did not happen
                self.write(P.encode_connack(False, P.RC_SERVER_UNAVAILABLE if v5 else P.SERVER_UNAVAILABLE,
                                            None, v5))
                self.abort()
                return
            if self.state != "login" or session.closed:
                return  # gone, or taken over, while its will was synced
            self.state = "open"
            srv.count(self.level, "connections_opened")
            self.parser.max_packet = srv.config.max_packet_size
            session.open(c)
        except Exception:  # noqa: BLE001 - one connection's failure, logged with its traceback
            log.exception("internal error starting the MQTT session of %s", self.peer_host)
            self.abort()
            return
        self.keepalive = c.keepalive * 1.5
        self._arm(self.keepalive)
        if user.expires_at is not None:  # an access token's user (broker.auth.oauth)
            self.expiry = asyncio.get_running_loop().call_later(
                max(0.0, user.expires_at - time.time()), self._credential_expired)
        pending, self.pending = self.pending, []
        for p in pending:
            if self.state != "open":
                break
            self._packet(p)

    async def _synced(self, vhost: str) -> bool:
        """Wait for the group commit of the session state just written in ``vhost`` (and, in a
        cluster, its in-sync followers): True once durable."""
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self.server.after_sync(lambda ok: None if done.done() else done.set_result(ok),
                               {self.server.registry.states.files_of(vhost)})
        return await done

    def _refusal(self, c: P.Connect) -> int:
        """The CONNACK code of a CONNECT refused before its credentials are checked, or 0."""
        if c.level not in (3, 4, 5):
            return P.BAD_PROTOCOL_VERSION
        v5 = c.level == 5
        if not c.client_id and not c.clean_session and not v5:
            return P.IDENTIFIER_REJECTED  # a persistent session needs a name to come back to
        if v5 and PR.AUTH_METHOD in c.props:
            return P.RC_BAD_AUTH_METHOD  # no enhanced authentication (AUTH) yet
        if c.username is None:  # no anonymous logins: the same users as AMQP
            return P.RC_BAD_CREDENTIALS if v5 else P.NOT_AUTHORIZED
        return P.ACCEPTED

    # ------------------------------------------------------------------ timers
    def _arm(self, seconds: float) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if seconds > 0:
            self.timer = asyncio.get_running_loop().call_later(seconds, self._check_alive, seconds)

    def _check_alive(self, seconds: float) -> None:
        self.timer = None
        if self.state == "closed":
            return
        if self.state != "open":
            log.warning("MQTT connection from %s: no CONNECT within %.0f s: closing", self.peer_host, seconds)
            self.abort()
            return
        if self.held:  # not read by us (hold.py): what it sent waits in its socket
            self.last_seen = time.monotonic()
        idle = time.monotonic() - self.last_seen
        if idle >= seconds:
            log.warning("MQTT client '%s' from %s: silent for %.0f s (keepalive %.0f s): closing",
                        self.session.client_id if self.session else "", self.peer_host, idle, seconds / 1.5)
            self.abort(P.RC_KEEP_ALIVE_TIMEOUT)
            return
        self.timer = asyncio.get_running_loop().call_later(seconds - idle, self._check_alive, seconds)

    def _credential_expired(self) -> None:
        """The access token the client logged in with expired: closed, as RabbitMQ does (MQTT 5
        hears 0xA0, maximum connect time)."""
        self.expiry = None
        if self.state == "open":
            log.info("MQTT client '%s' from %s: its access token expired: closing",
                     self.session.client_id if self.session else "", self.peer_host)
            self.abort(RC_MAXIMUM_CONNECT_TIME)

    # ------------------------------------------------------------------ endings
    def abort(self, reason: int = P.RC_UNSPECIFIED) -> None:
        """An abnormal end: MQTT 5 hears why, the will goes out, the socket closes."""
        if self.session is not None:
            self.session.disconnect(reason)
        self.state = "closed"
        self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.relay is not None:
            self.relay.client_gone()
        held, self.stash = self.stash, b""
        if (held or self.rest) and self.state == "open":  # what it sent before it closed (a DISCONNECT)
            self._read(held, budget=False)
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.expiry is not None:
            self.expiry.cancel()
            self.expiry = None
        if self.session is not None and not self.session.closed:
            try:  # its will armed and a persistent session's state on disk before the line is logged
                self.session.end(normal=False)
            except Exception:  # noqa: BLE001 - logged; the connection is gone either way
                log.exception("internal error ending the MQTT session of %s", self.peer_host)
            log.warning("MQTT client '%s' from %s closed the connection unexpectedly",
                        self.session.client_id, self.peer_host)
        self.state = "closed"
        self.server.connections.discard(self)

    def pause_writing(self) -> None:
        self.writable = False
        if self.relay is not None:
            self.relay.client_paused(True)
        elif self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.writable = True
        if self.relay is not None:
            self.relay.client_paused(False)
            return
        if not self.held and self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()
        if self.session is not None and not self.session.closed:
            self.session.resume()


def _level(s: MQTTSession) -> int:
    """The protocol level of a connected session's connection (its output is the protocol)."""
    return s.out.level if isinstance(s.out, MQTTProtocol) else 4


class MQTTServer:
    """The MQTT listeners (plain and TLS) of one node, over its vhosts and users."""

    def __init__(self, config: MqttConfig, vhosts: dict[str, VHost], users: UserStore,
                 after_sync: AfterSync, retained: FilesOf, sessions: FilesOf,
                 peers: Mapping[Peer, Peer] | None = None) -> None:
        self.config = config
        self.vhosts = vhosts
        self.users = users
        self.after_sync = after_sync
        self.settings = Settings(config.exchange, config.prefetch, config.max_packet_size,
                                 config.max_subscriptions)
        self.registry = Registry(Retained(retained, config.max_retained),
                                 lambda delay, fn: asyncio.get_running_loop().call_later(delay, fn),
                                 SessionStates(sessions), vhosts, users, self.settings)
        users.on_change.append(self.registry.permissions_changed)
        self.peers = peers if peers is not None else {}
        self.connections: set[MQTTProtocol] = set()
        self.listeners = Listeners("MQTT", log)  # plain, TLS and Unix-socket listeners
        self._tasks: set[asyncio.Task[None]] = set()
        self.hold = PublisherHold()
        self.router: Router | None = None  # a node of several workers: who owns a vhost (hand-over)

    # ------------------------------------------------------------------ views.FrontEndView
    def count(self, level: int, name: str, n: int = 1) -> None:
        counters = self.registry.counters[VERSIONS[level][1]]
        counters[name] = counters.get(name, 0) + n

    def open_connections(self) -> list[MQTTProtocol]:
        return [c for c in self.connections if c.state == "open" and c.session is not None]

    def close_vhost_clients(self, vhost: str, reason: str) -> int:
        """MQTT 5 clients hear DISCONNECT 0x9C (use another server: the shard's next server,
        which their reconnect reaches); 3.1.1 clients see the socket close."""
        gone = [c for c in self.connections if c.state != "closed" and c.vhost == vhost]
        for conn in gone:
            log.info("MQTT client '%s' from %s: closing: %s", conn.client_id, conn.peer_host, reason)
            conn.abort(P.RC_USE_ANOTHER_SERVER)
        return len(gone)

    def consumers(self) -> Iterator[tuple[MQTTProtocol, MQTTConsumer]]:
        for conn in self.open_connections():
            assert conn.session is not None
            for c in conn.session.consumers.values():
                yield conn, c

    def protocol_counters(self) -> dict[str, dict[str, int]]:
        out = {label: {**c, "publishers": 0, "consumers": 0} for label, c in self.registry.counters.items()}
        for conn in self.open_connections():
            s = conn.session
            assert s is not None
            c = out[VERSIONS[conn.level][1]]
            c["publishers"] += int(s.published)
            c["consumers"] += len(s.consumers)
        return out

    def session_entries(self, vhost: str | None = None) -> list[SessionEntry]:
        """``views.SessionsView``: every session, connected or away, unrendered (``overview.py``)."""
        return overview.entries(self.registry, self.vhosts, vhost)

    def session(self, vhost: str, client_id: str) -> dict[str, Any] | None:
        """``views.SessionsView``: one session as the API shows it."""
        return overview.session(self.registry, self.vhosts, self.settings.exchange, _level, vhost, client_id)

    def spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def start(self, tls: Callable[[], ssl.SSLContext] | None = None, unix_mode: int = 0o660) -> None:
        cfg = self.config
        for name in list(self.vhosts):
            self.open_vhost(name)
        shared = self.router is not None  # every worker on the node's ports
        if cfg.port >= 0:
            await self.listeners.tcp("mqtt", lambda: MQTTProtocol(self), cfg.bind, cfg.port,
                                     reuse_port=shared)
        if tls is not None and cfg.tls_port >= 0:
            await self.listeners.tcp("mqtts", lambda: MQTTProtocol(self), cfg.bind, cfg.tls_port, tls(),
                                     reuse_port=shared)
        if cfg.unix_path:
            await self.listeners.unix(lambda: MQTTProtocol(self, unix=True), cfg.unix_path, unix_mode)

    def open_vhost(self, vhost: str) -> None:
        """``vhost`` is served here (at start, or its shard opened here): its retained messages and
        persistent sessions' state read from its directory, and its sessions' wills armed."""
        registry, now = self.registry, time.time()
        registry.retained.open(vhost)
        for key in registry.states.open(vhost):
            state = registry.states.by_key[key]
            if state.will is not None:  # wills that waited out their delay across a restart
                arm_will(registry, key, self._ended(key, state))
            elif state.expired(now):  # a session that expired while no node served it
                try:
                    registry.states.forget(key)
                except OSError as exc:
                    log.warning("MQTT session state of '%s' stays: %s", key[1], exc)

    def close_vhost(self, vhost: str) -> None:
        """``vhost`` is no longer served here (its shard moved): its state is forgotten in memory
        (its files stay, its next server's), its armed wills are not ours to publish."""
        self.registry.retained.close(vhost)
        self.registry.states.close(vhost)
        for key in [k for k in self.registry.delayed_wills if k[0] == vhost]:
            self.registry.delayed_wills.pop(key).cancel()

    def _ended(self, key: Key, state: SessionState) -> PendingWill:
        """A kept will at start: one whose client was connected when the node went is due its
        will delay from now (that connection ended abnormally), kept so (``durable.py``)."""
        pending = state.will
        assert pending is not None
        if not pending.live:
            return pending
        state.will = dataclasses.replace(pending, due=time.time() + pending.delay)
        try:
            self.registry.states.save(key, state)
        except OSError as exc:
            log.warning("MQTT will of '%s' kept as it was: %s", key[1], exc)
        return state.will

    @property
    def addresses(self) -> dict[str, tuple[str, int]]:
        return self.listeners.addresses

    async def resume(self, fd: int, state: dict[str, Any]) -> None:
        """Serve a connection another worker of this node accepted for one of our vhosts: read
        again what it read (CONNECT and anything after it), as our own listener would have."""
        proto = await take_over(fd, lambda: MQTTProtocol(self, unix=bool(state.get("unix")),
                                                         websocket=bool(state.get("websocket"))))
        if not isinstance(proto, MQTTProtocol):
            log.info("handed-over MQTT connection lost before it was taken")
            return
        peer = state.get("peer")
        if isinstance(peer, (tuple, list)):
            proto.peer_host, proto.peer_port = str(peer[0]), int(peer[1])
        proto.remapped = True  # the accepting worker looked the peer up already
        proto.tls = state.get("tls")
        proto.first = None
        proto.data_received(bytes(state.get("rest", b"")))

    async def stop(self) -> None:
        if self.registry.permissions_changed in self.users.on_change:
            self.users.on_change.remove(self.registry.permissions_changed)
        self.listeners.close(self.config.unix_path)
        for conn in list(self.connections):
            conn.abort(P.RC_SERVER_SHUTTING_DOWN)
        for task in list(self._tasks):
            task.cancel()
        self.hold.close()
