"""The running broker's shared state, handed to every session.

Not a global: the node builds one ``Broker`` and passes it to the listener,
which passes it to each ``Session``. It holds the vhosts, users, the group
commit ``Syncer``, live connections, direct reply-to routes and counters.
"""

from __future__ import annotations

import logging
import platform
import struct
import time
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any, Protocol

from pamqp import commands

from broker import __version__, errors
from broker.amqp import codec
from broker.amqp.alarms import Alarms, DiskAlarm
from broker.amqp.memory import MemoryAlarm, watermark
from broker.amqp.sizes import MessageSizes
from broker.auth import sasl
from broker.auth.users import User, UserStore
from broker.config import Config
from broker.model.vhost import VHost

if TYPE_CHECKING:
    from broker.amqp.session import ChannelState, Session
    from broker.tls import PeerTLS

log = logging.getLogger(__name__)



NEED_MORE = None  # start_ok_user: the start-ok frame is not complete yet


def start_ok_user(data: bytes) -> str | None:
    """The user name a connection.start-ok frame at the start of ``data`` logs in as ("" when it
    names none or is not a start-ok), or None when the frame is not complete yet; for the login
    throttle, which must know the user before the credentials are checked. Frames longer than the
    spec's pre-tune limit are not waited for ("")."""
    found = _start_ok(data)
    return found if found is NEED_MORE or isinstance(found, str) else sasl.login_name(*found)


def start_ok_secret(data: bytes) -> str:
    """The password (or token) of the complete connection.start-ok at the start of ``data``, ""
    when it has none (EXTERNAL, malformed, not a start-ok)."""
    found = _start_ok(data)
    if found is NEED_MORE or isinstance(found, str):
        return ""
    try:
        return sasl.credentials(*found)[1]
    except errors.ConnectionAccessRefused:
        return ""


def _start_ok(data: bytes) -> tuple[str, bytes] | str | None:
    """(mechanism, response) of a start-ok at the start of ``data``; NEED_MORE; "" otherwise."""
    if len(data) < codec.FRAME_HDR.size:
        return NEED_MORE
    kind, _channel, size = codec.FRAME_HDR.unpack_from(data)
    if kind != codec.FRAME_METHOD or size > codec.FRAME_MIN_SIZE:
        return ""
    end = codec.FRAME_HDR.size + size
    if len(data) < end + 1:
        return NEED_MORE
    try:
        method = codec.decode_method(data[codec.FRAME_HDR.size:end])
        response = method.response if isinstance(method, commands.Connection.StartOk) else None
        raw = response.encode("latin-1") if isinstance(response, str) else bytes(response or b"")
    except (KeyError, ValueError, struct.error):
        return ""
    if not isinstance(method, commands.Connection.StartOk):
        return ""
    return str(method.mechanism), raw


class GroupCommit(Protocol):
    """What the AMQP glue needs of the node's group commit (``broker.syncer.Syncer``)."""

    enabled: bool

    @property
    def synchronous(self) -> bool: ...

    def after_sync(self, callback: Callable[[bool], None], deps: Collection[Any] | None = None) -> None:
        """``callback(ok)`` once what was written is durable; ``ok`` False if one of ``deps``
        (None: any object) failed to get there."""

    def discard(self, obj: Any) -> None: ...


class HeldReader(Protocol):
    """A publisher connection whose reading is held for the consumers of the queues it fed
    (``broker.net.server``): ``recheck_hold`` lets it go once they have caught up."""

    def recheck_hold(self) -> None: ...


class Shards(Protocol):
    """The node's shard map as a connection sees it (``broker.shards.worker``; None: one worker;
    on a cluster leader with ``[clustering] shard_servers``, the vhosts other nodes serve:
    ``broker.cluster.elsewhere``)."""

    # the hand-over carries the client's start-ok (``login``) to a node that checks it again
    replays_login: bool

    def elsewhere(self, vhost: str) -> bool:
        """True when another worker of this node owns ``vhost`` and is up: hand the connection
        over; errors.NotAllowed when its owner is down (restarting)."""

    def hand_over(self, fd: int, state: dict[str, Any]) -> None:
        """Pass the connection (its socket ``fd``, duplicated by the call) and its negotiated
        ``state`` to the owner of ``state["vhost"]``; OSError when that cannot be done."""


class Stats:
    """Plain integer counters: a publish costs one attribute increment (and its size, one
    histogram bucket). Counts that live on channels while they are open (publishes in confirm
    mode) are added here when a channel closes; the metrics add the open channels' at scrape."""

    __slots__ = ("published", "delivered", "acked", "confirmed", "unroutable", "connections_opened",
                 "returned", "gets", "gets_empty", "channels_opened", "delivered_autoack", "gets_autoack",
                 "received_confirm", "sizes")

    def __init__(self) -> None:
        self.published = 0
        self.delivered = 0  # consumer deliveries and basic.get-ok
        self.acked = 0
        self.confirmed = 0
        self.unroutable = 0  # returned ones included
        self.connections_opened = 0
        self.returned = 0  # unroutable mandatory messages sent back with basic.return
        self.gets = 0  # basic.get answered get-ok
        self.gets_empty = 0  # basic.get answered get-empty
        self.channels_opened = 0
        # of ``delivered`` and ``gets``: those without acknowledgement (RabbitMQ counts
        # deliveries and gets by ack mode)
        self.delivered_autoack = 0
        self.gets_autoack = 0
        self.received_confirm = 0  # publishes on confirm-mode channels since closed (chs.publish_seq)
        self.sizes = MessageSizes()  # body sizes of ``published``


log = logging.getLogger("skred")


def client_name(properties: dict[str, Any]) -> str:
    """What a client calls itself: its connection_name, else its product (and version)."""
    name = properties.get("connection_name")
    if name:
        return str(name)
    product = properties.get("product")
    version = properties.get("version")
    return f"{product} {version}" if product and version else str(product or "")

def server_properties() -> dict[str, Any]:
    """What connection.start tells a client about this broker (also what a node routing a
    connection to another node tells it first: broker/cluster/vhost_route.py)."""
    return {
        "product": "Skred",
        "version": __version__,
        "platform": f"Python {platform.python_version()}",
        "copyright": "Skred contributors",
        "information": "Disk-first AMQP 0-9-1 broker",
        "capabilities": {
            "publisher_confirms": True,
            "exchange_exchange_bindings": True,
            "basic.nack": True,
            "consumer_cancel_notify": True,
            "connection.blocked": True,
            "consumer_priorities": True,  # x-priority on basic.consume works
            "authentication_failure_close": True,
            "per_consumer_qos": True,
            "direct_reply_to": True,
        },
    }


class Broker:
    def __init__(self, config: Config, users: UserStore, vhosts: dict[str, VHost],
                 syncer: GroupCommit) -> None:
        self.config = config
        self.node_name = ""  # RabbitMQ's name@host; the node sets it (firehose trace headers)
        self.users = users
        users.on_change.append(self._permissions_changed)
        self.vhosts = vhosts
        self.syncer = syncer
        self.stats = Stats()
        self.connections: set[Session] = set()
        self.reply_to: dict[str, tuple[Session, ChannelState]] = {}
        # cluster members' addresses: they may send PROXY protocol headers
        self.trusted_peers: set[str] = set()
        # a cluster leader's own legs of follower tunnels -> the real client (broker.cluster.tunnel)
        self.proxied_peers: dict[tuple[str, int], tuple[str, int]] = {}
        # such a leg -> the client's TLS the member that carried it ended (broker.cluster.tunnel):
        # the certificate EXTERNAL logs in with on a plain listener (net/server.py)
        self.proxied_tls: dict[tuple[str, int], PeerTLS] = {}
        self.shards: Shards | None = None  # a worker of a multi-worker node (broker/shards)
        # publishers held for their queues' consumers, looked at after each write to a client
        self.held: set[HeldReader] = set()
        # guest with full access everywhere is the common case: skip per-name checks then
        self.check_permissions = True
        # resource alarms: block publishers (broker/amqp/alarms.py; checked by the listener tick)
        main = config.main
        self.alarm = Alarms(DiskAlarm(main.data_dir, main.free_disk_min), MemoryAlarm(
            watermark(main.vm_memory_high_watermark, main.vm_memory_high_watermark_absolute)))
        self._server_properties = server_properties()

    def server_properties(self) -> dict[str, Any]:
        return self._server_properties

    def authenticate(self, mechanism: str, response: bytes, peer_ip: str, name: str,
                     peer_tls: PeerTLS | None) -> User:
        """The user a connection.start-ok logs in as, or ConnectionAccessRefused.

        The listener has already waited out this source's login throttle
        (``broker.auth.throttle``); the outcome is reported to it here. Passwords
        are never logged, and a source in a burst of failures is logged once.
        """
        throttle = self.users.throttle
        key = self.users.throttle_key(peer_ip, sasl.login_name(mechanism, response))
        found: User | None
        if mechanism == "EXTERNAL":
            user = peer_tls.login_name(self.config.main.tls_cert_login_from) if peer_tls else None
            found = self.users.get(user) if user is not None else None
            if found is not None and not self.users.allowed_from(found, peer_ip):
                found = None
            reason = "no verified client certificate" if user is None else "unknown user"
        else:
            try:
                user, password = sasl.credentials(mechanism, response)
            except errors.ConnectionAccessRefused:
                throttle.failed(key, time.monotonic())
                raise
            found, refusal = self.users.login(user, password, peer_ip)
            reason = refusal or ""
        if found is not None:
            throttle.succeeded(key)
            return found
        if throttle.failed(key, time.monotonic()):
            log.warning("login refused for user %r from %s (mechanism %s: %s)", user, name, mechanism, reason)
        raise errors.ConnectionAccessRefused(
            f"Login was refused using authentication mechanism {mechanism}. "
            "For details see the broker logfile.")

    def _permissions_changed(self) -> None:
        """A user, permission, topic permission or limit changed: every connection checks
        afresh, so a revoked permission applies at once (RabbitMQ: to new channels)."""
        for session in self.connections:
            session.forget_permissions()

    def connection_opened(self, session: Session) -> None:
        self.connections.add(session)
        self.stats.connections_opened += 1
        vhost = session.vh.name if session.vh is not None else session.vhost  # set before the Open-Ok
        log.info("connection %s opened: user %r, vhost %r, client %r", session.name, session.username,
                 vhost, client_name(session.client_properties))
        log.debug("connection %s: client properties %r", session.name, session.client_properties)

    def connection_closed(self, session: Session) -> None:
        if session in self.connections:
            # RabbitMQ's words and level for a client that went away without closing
            level, how = ((logging.WARNING, "client unexpectedly closed TCP connection")
                          if session.vanished else (logging.INFO, "closed"))
            log.log(level, "connection %s %s: user %r, vhost %r, client %r, open %.1f s", session.name,
                    how, session.username, session.vhost, client_name(session.client_properties),
                    time.time() - session.connected_at)
        self.connections.discard(session)
        self.alarm.forget(session)
