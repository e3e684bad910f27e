"""The stream-protocol listener: an asyncio Protocol between a socket and a ``StreamSession``.

Theory of operation
-------------------
Bytes go to the frame reader (``codec.FrameReader``), frames to the session. Before the login a
frame may be at most ``UNAUTHENTICATED_MAX_FRAME`` bytes and the client has ``connect_timeout``
seconds to get through PeerProperties, SASL, Tune and Open; after it, the tuned ``frame_max``
bounds every frame. SaslAuthenticate is checked here, asynchronously (the login throttle of
every listener may make it wait), and frames that arrive meanwhile wait in a short list. A
malformed frame, a frame too large or a command out of place is answered with a Close carrying
the protocol's response code and the connection ends; a bug costs that one connection (logged),
never the broker. Reading stops while the socket's write buffer is full, and subscriptions take
no deliveries then. Heartbeats: we send one every ``heartbeat`` seconds of our silence and close
a client silent for two of its heartbeats.

On a node of several workers (``broker/shards``) every worker listens on the stream ports and a
connection belongs to the worker that owns its vhost, which Open names. The accepting worker did
the PeerProperties, SASL and Tune steps; at an Open for another worker's vhost it hands the
socket over (``broker.aio.give_away``; TLS: relays the bytes) with what was negotiated (the user,
frame_max, heartbeat, the address Open advertises), the Open frame and everything read after it.
The owner's ``StreamServer.resume`` builds a session in the "tune" state, handles that Open (its
own vhost access check answers it) and reads on: the client never sees the move. While the owner
restarts, Open is answered with a vhost access failure.

The management API and the metrics see the listener as a front end (``views.FrontEndView``):
an open connection is a ``ConnectionView`` (protocol ``RabbitMQ Stream``, no channels) whose
subscriptions are its consumers, and ``DELETE /api/connections/{name}`` closes it with a Close
(``CONNECTION_FORCED`` reason text: the API's). Counters are RabbitMQ's, under its label
``stream``.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, cast

from broker import errors
from broker.aio import Listeners, Relay, Router, hand_off, take_over
from broker.auth.throttle import TooManyFailures, check_login
from broker.auth.users import UNIX_PEER, UserStore
from broker.config import StreamConfig
from broker.errors import AMQPError
from broker.model.vhost import VHost
from broker.streamproto import codec as C
from broker.streamproto.session import AfterSync, Groups, Settings, StreamSession, Subscription
from broker.tls import PeerTLS

log = logging.getLogger(__name__)

UNAUTHENTICATED_MAX_FRAME = 64 * 1024
_PENDING_MAX = 16  # frames a client may send before its SaslAuthenticate is answered
_LOGIN_FRAMES = frozenset({C.PEER_PROPERTIES, C.SASL_HANDSHAKE, C.SASL_AUTHENTICATE, C.TUNE})  # before Open
Peer = tuple[str, int]


class StreamProtocol(asyncio.Protocol):
    def __init__(self, server: StreamServer, unix: bool = False) -> None:
        self.server = server
        self.unix = unix
        self.reader = C.FrameReader(UNAUTHENTICATED_MAX_FRAME)
        self.transport: asyncio.Transport | None = None
        self.session: StreamSession | None = None
        self.peer_host = ""
        self.peer_port = 0
        self.remapped = True  # the peer is final (False: a follower's tunnel may name another)
        self.tls: PeerTLS | None = None
        self.connected_at = time.time()
        self.recv_cnt = self.recv_oct = self.send_cnt = self.send_oct = 0
        self.writable = True
        self.logging_in = False
        self.pending: list[C.Frame] = []
        self.last_seen = time.monotonic()
        self.last_sent = time.monotonic()
        self.timer: asyncio.TimerHandle | None = None
        self.relay: Relay | None = None  # handed over to another worker, through us (TLS)
        # the client's login frames as they came, until Open, for a hand-over to another node
        # that checks the login again (``Router.replays_login``: the cluster leader's carrier)
        router = server.router
        self.login: dict[int, bytes] | None = {} if router is not None and router.replays_login else None

    # ------------------------------------------------------------ views.ConnectionView
    @property
    def name(self) -> str:
        """The client's ``connection_name`` property (the API also finds it by address)."""
        s = self.session
        return s.client_properties.get("connection_name", "") if s is not None else ""

    protocol = "RabbitMQ Stream"
    channel_max = 0
    auth_mechanism = "PLAIN"

    @property
    def listener(self) -> str:
        return "stream/ssl" if self.tls is not None else "stream"

    @property
    def vhost(self) -> str:
        s = self.session
        return s.vh.name if s is not None and s.state == "open" else ""

    @property
    def username(self) -> str:
        s = self.session
        return s.user.name if s is not None and s.user is not None else ""

    @property
    def peer(self) -> tuple[str, int]:
        return self.peer_host, self.peer_port

    @property
    def chs(self) -> Mapping[int, Any]:
        return {}  # the stream protocol has no channels

    @property
    def frame_max(self) -> int:
        return self.reader.max_frame

    @property
    def heartbeat(self) -> int:
        return self.session.heartbeat if self.session is not None else 0

    @property
    def client_properties(self) -> dict[str, Any]:
        return dict(self.session.client_properties) if self.session is not None else {}

    def consumers(self) -> list[Subscription]:
        """Its subscriptions, as the API lists consumers."""
        return list(self.session.subs.values()) if self.session is not None else []

    def close_connection(self, error: AMQPError) -> None:
        session = self.session
        if session is not None and not session.closed:
            log.warning("stream connection from %s: closing: %s", self.peer_host, error.reply_text)
            session.close_with(C.OK, error.reply_text)  # the protocol has no "forced" code

    def wakeup(self) -> None:
        pass  # writes go out as they are made

    # ----------------------------------------------------------- session.Output
    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)
            self.last_sent = time.monotonic()
            self.send_cnt += 1
            self.send_oct += len(data)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def soon(self, fn: Callable[[], None]) -> None:
        asyncio.get_running_loop().call_soon(fn)

    # ----------------------------------------------------------------- asyncio
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport = cast(asyncio.Transport, transport)
        srv = self.server
        info = transport.get_extra_info("peername")
        if self.unix:
            self.peer_host = UNIX_PEER
        elif info:
            self.peer_host, self.peer_port = str(info[0]), int(info[1])
            self.remapped = False
        self.tls = PeerTLS.of(transport.get_extra_info("ssl_object"))
        host, port = srv.advertised(transport.get_extra_info("sockname"))
        settings = Settings(srv.config.frame_max, srv.config.heartbeat, host, port)
        self.session = StreamSession(srv.vhosts, srv.users, settings, srv.after_sync, srv.groups, self,
                                     self.peer_host)
        srv.connections.add(self)
        self._arm(srv.config.connect_timeout)

    def data_received(self, data: bytes) -> None:
        if self.relay is not None:
            self.relay.to_owner(data)
            return
        if not self.remapped:
            # a follower's tunnel names its client before it sends the first byte (not before
            # the connection is accepted): the client's address is looked up now
            self.remapped = True
            self.peer_host, self.peer_port = self.server.peers.get(self.peer, self.peer)
            if self.session is not None:
                self.session.peer = self.peer_host
        self.last_seen = time.monotonic()
        self.recv_oct += len(data)
        session = self.session
        if session is None or session.closed:
            return
        try:
            frames = self.reader.feed(data)
        except C.Malformed as exc:
            self._refuse(exc)
            return
        self._frames(session, frames)

    def _frames(self, session: StreamSession, frames: list[C.Frame]) -> None:
        self.recv_cnt += len(frames)
        for i, f in enumerate(frames):
            if session.done():
                return
            if self.login is not None and f.key in _LOGIN_FRAMES:
                self.login.setdefault(f.key, C.raw_frame(f))  # the first of each: a session refuses more
            if f.key == C.OPEN and session.state == "tune" and not self.logging_in \
                    and self._handed_over(session, f, frames[i + 1:]):
                return
            self._frame(session, f)

    def _handed_over(self, session: StreamSession, f: C.Frame, after: list[C.Frame]) -> bool:
        """Give the connection to the worker that owns the vhost ``f`` (Open) names (see the
        module doc): True when it is no longer ours."""
        router, t = self.server.router, self.transport
        if router is None or t is None or session.user is None:
            return False
        try:
            c = C.Cursor(f.payload)
            corr, vhost = c.u32(), c.string()
        except C.Malformed:
            return False  # the session answers it
        try:
            if not router.elsewhere(vhost):
                return False
        except errors.NotAllowed as exc:
            log.warning("stream connection from %s: %s", self.peer_host, exc.reply_text)
            session.out.write(C.response(C.OPEN, corr, C.VHOST_ACCESS_FAILURE))
            session.close_with(C.VHOST_ACCESS_FAILURE, exc.reply_text)
            return True
        rest = b"".join(C.raw_frame(x) for x in [f, *after]) + self.reader.take()
        s = session.settings
        state = {"protocol": "stream", "vhost": vhost, "peer": list(self.peer), "unix": self.unix,
                 "user": session.user, "frame_max": session.frame_max, "heartbeat": session.heartbeat,
                 "advertised": (s.host, s.port), "rest": rest}
        if self.login is not None:
            state["login"] = b"".join(self.login.values())
            self.login = None
        self._arm(0)
        self.server.connections.discard(self)
        self.session = None  # nothing of it is ours to end
        self.relay = hand_off(t, router, state, f"stream connection from {self.peer_host}")
        return True

    def _frame(self, session: StreamSession, f: C.Frame) -> None:
        if self.logging_in:
            if len(self.pending) >= _PENDING_MAX:
                self._refuse(C.Malformed("too many frames before the login was answered"))
                return
            self.pending.append(f)
            return
        try:
            if session.state == "peer" and f.key == C.SASL_AUTHENTICATE:
                creds = session.sasl_credentials(f.payload)
                if creds is not None:
                    self.logging_in = True
                    self.server.spawn(self._login(session, *creds))
                return
            session.handle(f)
        except C.Malformed as exc:
            self._refuse(exc)
        except Exception:  # a bug must cost one connection, never the broker
            log.exception("internal error on stream connection from %s", self.peer_host)
            session.close_with(C.INTERNAL_ERROR, "internal error")
        if session.state == "open" and self.reader.max_frame == UNAUTHENTICATED_MAX_FRAME:
            self.login = None  # opened here: the credentials go
            self.server.opened += 1
            self.reader.max_frame = session.frame_max or self.server.config.frame_max
            self._arm(session.heartbeat)

    def _refuse(self, exc: C.Malformed) -> None:
        log.warning("stream connection from %s: %s: closing", self.peer_host, exc)
        if self.session is not None:
            self.session.close_with(exc.code, str(exc))
        else:
            self.close()

    async def _login(self, session: StreamSession, corr: int, name: str, password: str) -> None:
        srv = self.server
        try:
            user = await check_login(srv.users, name, password, self.peer_host, "stream")
        except TooManyFailures:
            user = None
        self.logging_in = False
        if session.closed:
            return
        session.logged_in(corr, user)
        pending, self.pending = self.pending, []
        self._frames(session, pending)

    # ------------------------------------------------------------------ timers
    def _arm(self, seconds: float) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if seconds > 0:
            self.timer = asyncio.get_running_loop().call_later(seconds, self._tick, seconds)

    def _tick(self, seconds: float) -> None:
        self.timer = None
        session = self.session
        if session is None or session.closed:
            return
        if session.state != "open":
            log.warning("stream connection from %s: not open within %.0f s: closing", self.peer_host, seconds)
            session.end()
            self.close()
            return
        now = time.monotonic()
        if now - self.last_seen >= 2 * seconds:
            log.warning("stream connection from %s: silent for %.0f s (heartbeat %d s): closing",
                        self.peer_host, now - self.last_seen, seconds)
            session.close_with(C.OK, "heartbeat timeout")
            return
        if now - self.last_sent >= seconds * 0.9:
            self.write(C.encode_heartbeat())
        self.timer = asyncio.get_running_loop().call_later(seconds, self._tick, seconds)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.relay is not None:
            self.relay.client_gone()
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.session is not None:
            try:
                self.session.end()
            except Exception:  # noqa: BLE001 - logged; the connection is gone either way
                log.exception("internal error ending the stream session of %s", self.peer_host)
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
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()
        if self.session is not None and not self.session.closed:
            self.session.resume()


class StreamServer:
    """The stream-protocol listeners (plain, TLS, Unix socket) of one node."""

    def __init__(self, config: StreamConfig, vhosts: dict[str, VHost], users: UserStore,
                 after_sync: AfterSync, peers: Mapping[Peer, Peer] | None = None) -> None:
        self.config = config
        self.vhosts = vhosts
        self.users = users
        self.after_sync = after_sync
        self.peers = peers if peers is not None else {}
        self.groups = Groups()
        self.connections: set[StreamProtocol] = set()
        self.opened = 0  # connections that got through Open (connections_opened)
        self.listeners = Listeners("stream protocol", log)
        self._tasks: set[asyncio.Task[None]] = set()
        self.router: Router | None = None  # a node of several workers: who owns a vhost (hand-over)

    def advertised(self, sockname: Any) -> tuple[str, int]:
        """The host and port Open and Metadata name: the configured ones, else the address
        the client reached us at (a Unix socket: the plain listener's)."""
        cfg = self.config
        host, port = "", 0
        if isinstance(sockname, tuple) and len(sockname) >= 2:
            host, port = str(sockname[0]), int(sockname[1])
        elif "stream" in self.listeners.addresses:
            host, port = self.listeners.addresses["stream"]
        return cfg.advertised_host or host, cfg.advertised_port or port

    # ------------------------------------------------------------ views.FrontEndView
    def open_connections(self) -> list[StreamProtocol]:
        return [c for c in self.connections if c.session is not None and c.session.state == "open"]

    def close_vhost_clients(self, vhost: str, reason: str) -> int:
        """Each connection of ``vhost`` gets the protocol's Close (it has no "moved" code; the
        client's recovery reconnects, through the node's port, to the shard's next server)."""
        gone = [c for c in self.open_connections() if c.vhost == vhost]
        for conn in gone:
            assert conn.session is not None
            log.info("stream connection from %s: closing: %s", conn.peer_host, reason)
            conn.session.close_with(C.OK, reason)
        return len(gone)

    def consumers(self) -> Iterator[tuple[StreamProtocol, Subscription]]:
        """Every open connection's subscriptions (``views.FrontEndView``): the API lists them
        with channel number 0, as RabbitMQ lists consumers that have no channel."""
        for conn in self.open_connections():
            for sub in conn.consumers():
                yield conn, sub

    # ------------------------------------------------------------ views.StreamEntitiesView
    def stream_publishers(self) -> Iterator[tuple[StreamProtocol, dict[str, Any]]]:
        for conn in self.open_connections():
            if conn.session is not None:
                for info in conn.session.publisher_infos():
                    yield conn, info

    def stream_consumers(self) -> Iterator[tuple[StreamProtocol, dict[str, Any]]]:
        for conn in self.open_connections():
            if conn.session is not None:
                for info in conn.session.consumer_infos():
                    yield conn, info

    def protocol_counters(self) -> dict[str, dict[str, int]]:
        """RabbitMQ's ``stream`` label; the counts of closed connections are not kept."""
        conns = [c.session for c in self.open_connections() if c.session is not None]
        received = sum(s.received for s in conns)
        delivered = sum(s.delivered for s in conns)
        return {"stream": {
            "messages_received": received, "messages_received_confirm": received,
            "messages_confirmed": sum(s.confirmed for s in conns), "messages_delivered": delivered,
            "messages_delivered_consume_auto_ack": delivered, "messages_delivered_consume_manual_ack": 0,
            "messages_acknowledged": 0, "connections_opened": self.opened,
            "publishers": sum(int(s.published) for s in conns), "consumers": sum(len(s.subs) for s in conns),
        }}

    def spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def start(self, tls: Callable[[], ssl.SSLContext] | None = None, unix_mode: int = 0o660) -> None:
        cfg = self.config
        def factory() -> StreamProtocol:
            return StreamProtocol(self)

        shared = self.router is not None  # every worker on the node's ports
        if cfg.port >= 0:
            await self.listeners.tcp("stream", factory, cfg.bind, cfg.port, reuse_port=shared)
        if tls is not None and cfg.tls_port >= 0:
            await self.listeners.tcp("stream/ssl", factory, cfg.bind, cfg.tls_port, tls(), reuse_port=shared)
        if cfg.unix_path:
            await self.listeners.unix(lambda: StreamProtocol(self, unix=True), cfg.unix_path, unix_mode)

    @property
    def addresses(self) -> dict[str, tuple[str, int]]:
        return self.listeners.addresses

    async def resume(self, fd: int, state: dict[str, Any]) -> None:
        """Serve a connection another worker of this node took to Open for one of our vhosts
        (see the module doc): its negotiated state, then the Open and what followed it."""
        proto = await take_over(fd, lambda: StreamProtocol(self, unix=bool(state.get("unix"))))
        session = proto.session if isinstance(proto, StreamProtocol) else None
        if not isinstance(proto, StreamProtocol) or session is None:
            log.info("handed-over stream connection lost before it was taken")
            return
        peer_host, peer_port = state["peer"]
        proto.peer_host, proto.peer_port = str(peer_host), int(peer_port)
        session.peer = proto.peer_host
        proto.remapped = True  # the accepting worker looked the client's address up already
        host, port = state["advertised"]
        session.settings = Settings(self.config.frame_max, self.config.heartbeat, str(host), int(port))
        passed = state["user"]
        user = self.users.get(passed.name) if passed.expires_at is None else passed  # a token's is whole
        if user is None:
            session.close_with(C.AUTHENTICATION_FAILURE, "user deleted")
            return
        session.user = user
        session.state = "tune"
        session.frame_max, session.heartbeat = int(state["frame_max"]), int(state["heartbeat"])
        proto.data_received(bytes(state["rest"]))

    async def stop(self) -> None:
        self.listeners.close(self.config.unix_path)
        for conn in list(self.connections):
            if conn.session is not None:
                conn.session.close_with(C.OK, "broker shutting down")
            else:
                conn.close()
        for task in list(self._tasks):
            task.cancel()
