"""One client's AMQP session: the sans-IO connection wired to the broker model.

Theory of operation
-------------------
``Session`` subclasses the sans-IO ``AMQPConnection`` and implements its hooks
with the vhost model: declares, bindings, publish -> route -> append, consumers,
acks, confirms and transactions. It never touches a socket: bytes go to
``self.out`` and ``self.wakeup()`` asks the network layer to flush them.

Per channel (``ChannelState``): unacked deliveries by delivery tag (an
insertion-ordered dict, so ``multiple=true`` acks walk it from the front), the
consumers, prefetch limits, confirm sequence numbers and an optional
transaction buffer.

Confirms are coalesced: after each read batch every channel that published
sends one ``basic.ack(multiple=true)`` up to its last sequence number. If any
of those messages is persistent and reached a durable queue, the ack waits
for the node's group commit (``Syncer``): one fsync covers every confirm
pending at that moment. Replies that promise durability (a durable declare,
tx.commit) are deferred the same way, and later replies on that channel queue
behind them so the client sees them in order.
"""

from __future__ import annotations

import base64
import logging
import os
import time
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any

from pamqp import commands
from pamqp.base import Frame as PFrame

from broker import errors, properties
from broker.amqp import codec
from broker.amqp.connection import CH_OPEN, AMQPConnection, PublishArgs, State
from broker.model import methods, trace
from broker.model.publish import BatchOutcome, PublishOutcome, PublishRequest
from broker.model.queue import Consumer, Queue
from broker.properties import FLAG_REPLY_TO, FLAG_USER_ID, HI_REPLY_TO

if TYPE_CHECKING:
    from broker.amqp.broker import Broker
    from broker.auth.users import User
    from broker.model.vhost import VHost
    from broker.tls import PeerTLS

log = logging.getLogger(__name__)

REPLY_TO = "amq.rabbitmq.reply-to"
REPLY_TO_PREFIX = "amq.rabbitmq.reply-to."
_DEFERRED = object()
_EAGER_FLUSH = 16 * 1024  # manual ack: write deliveries this soon, so acks can start flowing
_DIRECT_WRITE = 32 * 1024  # deliveries this large go to the transport as they are
_EAGER_FLUSH_AUTOACK = 256 * 1024  # autoack: only bound the buffer (fewer, larger writes)
_U64_PACK = codec.U64.pack
_SIZES_HEAD = codec.HEADER_AFTER_METHOD.pack  # the size-dependent pieces of a delivery
_SIZES_BODY = codec.BODY_AFTER_HEADER.pack
_END, _HEADER, _BODY, _END_BYTE = codec.FRAME_END, codec.FRAME_HEADER, codec.FRAME_BODY, codec.FRAME_END_BYTE
_FRAME_OVERHEAD = codec.FRAME_OVERHEAD


class ChannelState:
    __slots__ = (
        "id", "unacked", "next_tag", "consumers", "prefetch", "global_prefetch", "unacked_count",
        "flow", "confirm", "publish_seq", "confirmed", "needs_sync", "sync_deps", "sync_waiting", "tx",
        "deferred", "reply_token", "reply_tag", "open", "nacks", "head_tag", "head_since",
        "last_queue", "publishing", "n_published", "n_acked", "origin", "n_get", "n_get_no_ack",
        "n_deliver_no_ack", "n_redelivered",
    )

    def __init__(self, ch: int, origin: trace.Origin) -> None:
        self.id = ch
        self.origin = origin  # who this channel's publishes and deliveries come from (firehose)
        self.unacked: dict[int, tuple[Queue, int, SessionConsumer | None]] = {}
        self.next_tag = 1
        self.consumers: dict[str, SessionConsumer] = {}
        self.prefetch = 0
        self.global_prefetch = 0
        self.unacked_count = 0
        self.flow = True
        self.confirm = False
        self.publish_seq = 0
        self.confirmed = 0
        self.needs_sync = False
        # The stores the confirms waiting for the next group commit depend on (None: unknown,
        # every store): only their failure to sync nacks them (broker.syncer).
        self.sync_deps: set[Any] | None = set()
        self.sync_waiting = False
        self.tx: list[tuple[Any, ...]] | None = None
        self.deferred: list[Any] | None = None
        self.reply_token: str | None = None
        self.reply_tag: str | None = None
        self.open = True
        self.nacks: list[int] | None = None  # publish seqs a queue refused (reject-publish)
        # consumer timeout: oldest unacked tag and since when it is the oldest (broker/amqp/alarms.py)
        self.head_tag = 0
        self.head_since = 0.0
        self.last_queue = ""  # the channel's last declared queue: what an empty queue name means
        # published without confirms (confirm mode: publish_seq > 0): a publisher, in the metrics
        self.publishing = False
        # the channel's own message counters, for its rates and history in the management API
        # (deliveries and gets are its delivery tags: ``next_tag - 1``, of which basic.gets, with
        # and without acks, and no-ack deliveries are counted apart, so that manual-ack
        # deliveries, the common case, cost no count of their own; confirms: ``confirmed``)
        self.n_published = 0
        self.n_acked = 0
        self.n_get = 0
        self.n_get_no_ack = 0
        self.n_deliver_no_ack = 0
        self.n_redelivered = 0  # deliveries and gets flagged redelivered

    @property
    def publisher(self) -> bool:
        return self.publishing or self.publish_seq > 0


class SessionConsumer(Consumer):
    __slots__ = ("session", "chs", "prefetch", "unacked", "prefix", "_t_key", "_t_parts")

    def __init__(self, session: Session, chs: ChannelState, tag: str, queue: Queue, no_ack: bool,
                 exclusive: bool, arguments: dict[str, Any]) -> None:
        super().__init__(tag, queue, no_ack, exclusive, arguments)
        self.session = session
        self.chs = chs
        self.prefetch = chs.prefetch
        self.unacked = 0
        # basic.deliver method id + consumer tag, encoded once
        self.prefix = codec.METHOD_ID.pack(0x003C003C) + codec.shortstr(tag.encode())
        # the last delivery's (exrk, props size, body size, redelivered) and its encoded frame parts
        self._t_key: tuple[bytes, int, int, bool] = (b"", -1, -1, False)
        self._t_parts: tuple[bytes, bytes, bytes, bytes] = (b"", b"", b"", b"")

    def ready(self) -> bool:
        chs = self.chs
        if not (self.session.writable and chs.flow):
            return False
        if self.no_ack:
            return True
        if self.prefetch and self.unacked >= self.prefetch:
            return False
        return not chs.global_prefetch or chs.unacked_count < chs.global_prefetch

    def deliver(self, msgid: int, exchange: bytes, routing_key: bytes, props: bytes, body: bytes,
                redelivered: bool) -> None:
        # exchange and routing key as the short-string pair the hot path takes
        exrk = codec.shortstr(exchange) + codec.shortstr(routing_key)
        self.deliver_raw(msgid, exrk, props, body, redelivered)

    def capacity(self) -> int:
        chs = self.chs
        if not (self.session.writable and chs.flow):
            return 0
        if self.no_ack:
            return 1 << 30
        k = self.prefetch - self.unacked if self.prefetch else 1 << 30
        if chs.global_prefetch:
            k = min(k, chs.global_prefetch - chs.unacked_count)
        return k

    def deliver_raw(self, msgid: int, exrk: bytes, props: bytes, body: bytes | memoryview,
                    redelivered: bool) -> None:
        chs = self.chs
        tag = chs.next_tag
        chs.next_tag = tag + 1
        s = self.session
        if not self.no_ack:
            chs.unacked[tag] = (self.queue, msgid, self)
            self.unacked += 1
            chs.unacked_count += 1
        else:
            s.stats.delivered_autoack += 1
            chs.n_deliver_no_ack += 1
        if redelivered:
            chs.n_redelivered += 1
        body_len = len(body)
        key = self._t_key
        if key[2] == body_len and key[1] == len(props) and key[0] == exrk and key[3] == redelivered:
            # the same kind of delivery as the last one: pack only the tag
            head, before, after, tail = self._t_parts
            data = b"".join((head, _U64_PACK(tag), before, props, after, body, tail))
        elif key[0] == exrk and key[3] == redelivered and 0 < body_len <= s.frame_max - _FRAME_OVERHEAD:
            # other sizes (a message-id, headers, a body that differ every message): pack the sizes
            ch = chs.id
            data = b"".join((self._t_parts[0], _U64_PACK(tag), b"\x01" if redelivered else b"\x00", exrk,
                             _SIZES_HEAD(_END, _HEADER, ch, 12 + len(props), 60, 0, body_len), props,
                             _SIZES_BODY(_END, _BODY, ch, body_len), body, _END_BYTE))
        elif self._retemplate(exrk, len(props), body_len, redelivered):
            head, before, after, tail = self._t_parts
            data = b"".join((head, _U64_PACK(tag), before, props, after, body, tail))
        else:  # a body over several frames
            data = codec.encode_delivery_raw(chs.id, self.prefix, tag, redelivered, exrk, props, body,
                                             s.frame_max)
        s.stats.delivered += 1
        self._send(data)
        vh = s.vh
        if vh is not None and vh.meta.tracing:  # firehose: the deliver.<queue> copy
            trace.delivered_exrk(vh, chs.origin, self.queue.name, exrk, props, body, redelivered, s.now_ms)

    def _send(self, data: bytes) -> None:
        s = self.session
        if len(data) >= _DIRECT_WRITE and s.write_now is not None:
            s.write_now(data)  # a large delivery skips the copy into ``out``
            return
        out = s.out
        out += data
        if len(out) >= (_EAGER_FLUSH_AUTOACK if self.no_ack else _EAGER_FLUSH) and s.flush_now is not None:
            # Long delivery runs go out while we prepare the rest: the client can ack
            # the first part of a prefetch window before the last part is written.
            s.flush_now()
        elif not s.flush_pending:
            s.wakeup()

    def deliver_same(self, msgids: range | None, exrk: bytes, props: bytes, bodies: list[bytes]) -> None:
        """A run of deliveries that differ only in their bodies (``Consumer.deliver_same``):
        the delivery template is checked once and the frames are joined once."""
        body_len = len(bodies[0])
        key = self._t_key
        vh = self.session.vh
        traced = vh is not None and vh.meta.tracing  # one by one, each traced
        if traced or not ((key[2] == body_len and key[1] == len(props) and key[0] == exrk and not key[3])
                or self._retemplate(exrk, len(props), body_len, False)):
            super().deliver_same(msgids, exrk, props, bodies)
            return
        chs = self.chs
        tag = chs.next_tag
        k = len(bodies)
        chs.next_tag = tag + k
        if msgids is not None and not self.no_ack:
            q = self.queue
            chs.unacked.update(zip(range(tag, tag + k), [(q, msgid, self) for msgid in msgids], strict=True))
            self.unacked += k
            chs.unacked_count += k
        head, before, after, tail = self._t_parts
        middle = b"".join((before, props, after))
        parts: list[bytes] = []
        add = parts.extend
        for body in bodies:
            add((head, _U64_PACK(tag), middle, body, tail))
            tag += 1
        stats = self.session.stats
        stats.delivered += k
        if self.no_ack:
            stats.delivered_autoack += k
            chs.n_deliver_no_ack += k
        self._send(b"".join(parts))

    def deliver_many(self, msgids: list[int] | None, exrk: bytes, props: list[bytes],
                     bodies: list[bytes]) -> None:
        """First-time deliveries with one exchange and routing key (``Consumer.deliver_many``;
        ``msgids`` None: autoack deliveries of a publish run that was never stored): one
        template check per message (sizes only), one joined write for all of them."""
        vh = self.session.vh
        if vh is not None and vh.meta.tracing:  # one by one, each traced
            super().deliver_many(msgids, exrk, props, bodies)
            return
        chs = self.chs
        tag = chs.next_tag
        k = len(bodies)
        if msgids is not None and not self.no_ack:
            q = self.queue
            chs.unacked.update(zip(range(tag, tag + k), [(q, msgid, self) for msgid in msgids], strict=True))
            self.unacked += k
            chs.unacked_count += k
        key = self._t_key
        frame_max = self.session.frame_max
        if key[0] != exrk or key[3]:
            self._retemplate(exrk, len(props[0]), len(bodies[0]), False)
            key = self._t_key
        head, before, after, tail = self._t_parts
        p_len = key[1]
        b_len = key[2]
        ok = key[0] == exrk and not key[3]
        pre = b"\x00" + exrk
        sized = codec.tag_to_body_size(len(pre))
        ch = chs.id
        max_body = frame_max - _FRAME_OVERHEAD
        parts: list[bytes] = []
        add = parts.extend
        for p, body in zip(props, bodies, strict=True):
            bl = len(body)
            if ok and bl == b_len and len(p) == p_len:
                add((head, _U64_PACK(tag), before, p, after, body, tail))
            elif ok and 0 < bl <= max_body:  # other sizes: pack them
                add((head, sized(tag, pre, _END, _HEADER, ch, 12 + len(p), 60, 0, bl), p,
                     _SIZES_BODY(_END, _BODY, ch, bl), body, _END_BYTE))
            else:  # an empty body, or one over several frames (a small frame_max)
                add((codec.encode_delivery_raw(ch, self.prefix, tag, False, exrk, p, body, frame_max),))
            tag += 1
        chs.next_tag = tag
        stats = self.session.stats
        stats.delivered += k
        if self.no_ack:
            stats.delivered_autoack += k
            chs.n_deliver_no_ack += k
        self._send(b"".join(parts))

    def _retemplate(self, exrk: bytes, props_len: int, body_len: int, redelivered: bool) -> bool:
        """Encode the fixed frame parts for deliveries like this one; False if its body
        does not fit one frame (nothing worth keeping then)."""
        if body_len > self.session.frame_max - codec.FRAME_OVERHEAD:
            return False
        self._t_key = (bytes(exrk), props_len, body_len, redelivered)
        self._t_parts = codec.delivery_template(self.chs.id, self.prefix, redelivered, exrk, props_len,
                                                body_len)
        return True

    def cancelled_by_server(self) -> None:
        s = self.session
        chs = self.chs
        chs.consumers.pop(self.tag, None)
        if chs.open and s.capabilities.get("consumer_cancel_notify"):
            cancel = commands.Basic.Cancel(consumer_tag=self.tag, nowait=True)
            if s.held_cancels is not None:  # queue.delete on this connection: after its delete-ok
                s.held_cancels.append((chs, cancel))
                return
            s.reply(chs, cancel)
            s.wakeup()


class Session(AMQPConnection):
    """AMQP semantics for one connection. The network layer sets ``wakeup``."""

    protocol = "AMQP 0-9-1"  # as the management API shows it (views.ConnectionView)

    @property
    def listener(self) -> str:
        return "amqp/ssl" if self.tls is not None else "amqp"

    def __init__(self, broker: Broker, peer: tuple[str, int], wakeup: Callable[[], None]) -> None:
        cfg = broker.config
        super().__init__(
            frame_max=cfg.amqp.frame_max,
            channel_max=cfg.amqp.channel_max,
            heartbeat=cfg.amqp.heartbeat,
            max_message_size=cfg.main.max_message_size,
            max_bytes_in_flight=cfg.amqp.max_bytes_in_flight,
            server_properties=broker.server_properties(),
        )
        self.broker = broker
        self.peer = peer
        self.wakeup = wakeup
        self.writable = True
        self.vh: VHost | None = None
        self.chs: dict[int, ChannelState] = {}
        self._confirm_dirty: set[ChannelState] = set()
        self._perm_cache: dict[tuple[str, str], bool] = {}
        self.connected_at = time.time()
        # socket reads and writes, and their bytes (the network layer counts them; the API's
        # recv_cnt/recv_oct/send_cnt/send_oct)
        self.recv_cnt = self.recv_oct = self.send_cnt = self.send_oct = 0
        self.tls: PeerTLS | None = None  # set by the listener for an AMQPS connection
        self.auth_mechanism = ""
        self.principal: User | None = None  # who logged in (broker.auth.users; a token's user)
        self.batch_publishes = 0  # publishes in the current read batch (fairness)
        self.flush_pending = False  # a flush of ``out`` is already scheduled
        self.flush_now: Callable[[], None] | None = None  # set by the network layer
        self.write_now: Callable[[bytes], None] | None = None  # flush ``out``, then write this
        self.now_ms = 0  # wall clock of the current read batch: message timestamps
        self.stats = broker.stats
        self._write_ok: set[str] = set()  # exchanges this user may publish to (cache)
        self.batch_queues: set[Queue] = set()  # queues with consumers it published to
        self.unanswered = False  # published without confirms since the network layer last looked
        self.name = f"{peer[0]}:{peer[1]}"
        # basic.cancel notices held back while this connection deletes a queue (RabbitMQ order)
        self.held_cancels: list[tuple[ChannelState, commands.Basic.Cancel]] | None = None

    def receive_data(self, data: bytes) -> None:
        self.now_ms = int(time.time() * 1000)
        super().receive_data(data)

    def closed_by_server(self, channel: int, error: errors.AMQPError) -> None:
        what = f"channel {channel}" if channel else "connection"
        level = logging.INFO if error.reply_code in (200, 320) else logging.WARNING
        method = codec.method_label(error.class_id, error.method_id)
        cause = f"operation {method} caused " if method else ""
        log.log(level, "closing %s of %s (user %r, vhost %r): %s%d %s", what, self.name, self.username,
                self.vhost, cause, error.reply_code, error.reply_text)

    def update_secret(self, secret: bytes, reason: str) -> bool:
        """A token refresh: the new secret must log the same user in (the user store's check);
        a token's user then has the new token's permissions and expiry. A token signed by a key
        not fetched yet is answered once the issuer's keys are fetched (True: answered later)."""
        text = secret.decode(errors="replace")
        keys = self.broker.users.pending(text)
        if keys is None:
            self._swap_secret(text, reason)
            return False

        def fetched(_: object) -> None:
            if self.state is not State.OPEN:
                return
            try:
                self._swap_secret(text, reason)
            except errors.AMQPError as exc:
                self.close_connection(errors.NotAllowed(exc.text, 10, 70))
            else:
                self.send_method(0, commands.Connection.UpdateSecretOk())
            self.wakeup()

        keys.add_done_callback(fetched)
        return True

    def _swap_secret(self, secret: str, reason: str) -> None:
        user, refusal = self.broker.users.login(self.username, secret, self.peer[0])
        if user is not None and user.name != self.username:
            refusal = f"the new secret logs in user {user.name!r}"
        if user is None or refusal is not None:
            log.warning("secret update refused for user %r from %s: %s", self.username, self.name, refusal)
            raise errors.NotAllowed(f"Secret update was refused for user '{self.username}'")
        self.principal = user
        self.forget_permissions()
        log.info("secret updated for user %r from %s (%s)", self.username, self.name, reason)

    def credential_expired(self) -> bool:
        """The access token this connection logged in with has expired (it must be closed)."""
        p = self.principal
        return p is not None and p.expires_at is not None and p.expired()

    # ------------------------------------------------------------ negotiation
    def authenticate(self, mechanism: str, response: bytes) -> str:
        user = self.broker.authenticate(mechanism, response, self.peer[0], self.name, self.tls)
        self.auth_mechanism = mechanism
        self.principal = user
        return user.name

    def open_vhost(self, vhost: str) -> None:
        vh = self.broker.vhosts.get(vhost)
        if vh is None and self.broker.shards is not None and self.broker.shards.elsewhere(vhost) \
                and self.broker.users.has_vhost_access(self._who, vhost):
            self.hand_over(vhost)  # another worker of this node owns it (broker/shards)
            return
        if vh is None or not self.broker.users.has_vhost_access(self._who, vhost):
            raise errors.NotAllowed(f"access to vhost '{vhost}' refused for user '{self.username}'")
        limit = vh.limits.max_connections  # vhost limit (broker/model/limits.py)
        if limit is not None and sum(1 for c in self.broker.connections if c.vh is vh) >= limit:
            raise errors.NotAllowed(f"access to vhost '{vhost}' refused for user '{self.username}': "
                                    f"connection limit ({limit}) is reached")
        limit = self._user_limit("max-connections")
        mine = (c for c in self.broker.connections if c.username == self.username)
        if limit is not None and sum(1 for _ in mine) >= limit:
            raise errors.NotAllowed(f"Connection refused for user '{self.username}'. User connection "
                                    f"limit ({limit}) is reached")
        self.vh = vh
        self.broker.connection_opened(self)

    # ---------------------------------------------------------------- helpers
    def reply(self, chs: ChannelState, method: PFrame) -> None:
        data = codec.encode_method(chs.id, method)
        if chs.deferred is not None:
            chs.deferred.append(data)
        else:
            self.out += data

    def reply_after_sync(self, chs: ChannelState, method: PFrame, deps: Collection[Any] | None) -> None:
        """Send ``method`` once everything written so far is on disk; if one of ``deps`` (the
        stores the operation wrote; None: any) failed to get there, the connection is closed
        with 541 instead: the client must not take a commit or declare it was never told is
        durable for one that is."""
        entry = [codec.encode_method(chs.id, method)]
        if chs.deferred is None:
            chs.deferred = []
        chs.deferred.append(entry)

        def done(ok: bool) -> None:
            if not chs.open or chs.deferred is None:
                return
            if not ok:
                self.close_connection(errors.InternalError(
                    f"{_answer_of(method)} failed: its data could not be written to disk"))
                self.wakeup()
                return
            # Emit our entry and everything queued behind it up to the next deferred one.
            while chs.deferred and chs.deferred[0] is not entry:
                chs.deferred.pop(0)  # pragma: no cover - defensive
            if chs.deferred:
                self.out += chs.deferred.pop(0)[0]
            while chs.deferred and isinstance(chs.deferred[0], (bytes, bytearray)):
                self.out += chs.deferred.pop(0)
            if not chs.deferred:
                chs.deferred = None
            self.wakeup()

        self.broker.syncer.after_sync(done, deps)

    def _channel(self, ch: int) -> ChannelState:
        return self.chs[ch]

    @property
    def _who(self) -> User | str:
        """Whom the permission checks ask about: the logged-in user (a token's user carries its
        own grants; an internal one is looked up by name on every check)."""
        return self.principal if self.principal is not None else self.username

    def forget_permissions(self) -> None:
        """Drop the remembered permission checks (the user store changed)."""
        self._perm_cache.clear()
        self._write_ok.clear()

    def _check(self, kind: str, name: str, resource: str = "queue") -> None:
        """Raise 403 unless the user has ``kind`` (configure/write/read) permission on ``name``,
        the ``resource`` ("queue" or "exchange") the refusal text names, as RabbitMQ's does."""
        key = (kind, name)
        ok = self._perm_cache.get(key)
        if ok is None:
            users = self.broker.users
            check = {"configure": users.can_configure, "write": users.can_write,
                     "read": users.can_read}[kind]
            ok = check(self._who, self.vhost, name)
            self._perm_cache[key] = ok
        if not ok:
            raise errors.AccessRefused(
                f"access to {resource} '{name}' in vhost "
                f"'{self.vhost}' refused for user '{self.username}'")

    @property
    def vhost_obj(self) -> VHost:
        assert self.vh is not None
        return self.vh

    # --------------------------------------------------------------- channels
    def _user_limit(self, name: str) -> int | None:
        """The user's limit ``name`` (RabbitMQ's user limits), None when unlimited (-1 or unset)."""
        user = self.broker.users.resolve(self._who)
        value = None if user is None else user.limits.get(name)
        return None if value is None or value < 0 else value

    def may_open_channel(self) -> None:
        limit = self._user_limit("max-channels")  # across the user's connections on this node
        if limit is not None and sum(len(c.chs) for c in self.broker.connections
                                     if c.username == self.username) >= limit:
            raise errors.NotAllowed(f"number of channels opened for user '{self.username}' has reached "
                                    f"the maximum allowed user limit of ({limit})")

    def channel_opened(self, channel: int) -> None:
        self.chs[channel] = ChannelState(channel, trace.Origin(self.broker.node_name, self.username,
                                                               self.name, channel))
        self.broker.stats.channels_opened += 1

    def channel_closed(self, channel: int) -> None:
        chs = self.chs.pop(channel, None)
        if chs is None:
            return
        chs.open = False
        self.broker.stats.received_confirm += chs.publish_seq  # the metrics count open channels' own
        self._confirm_dirty.discard(chs)
        for c in list(chs.consumers.values()):
            c.queue.remove_consumer(c)
        chs.consumers.clear()
        if chs.reply_token:
            self.broker.reply_to.pop(chs.reply_token, None)
        self._requeue_all(chs)

    def _requeue_all(self, chs: ChannelState) -> None:
        touched: list[Queue] = []
        for _tag, (q, msgid, c) in chs.unacked.items():
            q.reject(msgid, True)
            if c is not None:
                c.unacked -= 1
            if q not in touched:
                touched.append(q)
        chs.unacked.clear()
        chs.unacked_count = 0

    def connection_closing(self) -> None:
        self.broker.connection_closed(self)
        if self.vh is not None:
            self.vh.delete_exclusive(self)

    # ----------------------------------------------------------------- publish
    def handle_publish(self, channel: int, args: PublishArgs, props: bytes, body: bytes | memoryview) -> None:
        chs = self.chs[channel]
        self.batch_publishes += 1
        if chs.confirm:
            chs.publish_seq += 1
            self._confirm_dirty.add(chs)
        else:
            self.unanswered = True
            chs.publishing = True
        try:
            if props[1] & FLAG_USER_ID:
                self._check_user_id(props)
            if chs.tx is not None:
                self.vhost_obj.get_exchange(args.exchange)
                chs.tx.append(("publish", args, props, bytes(body)))
                return
            self._publish(chs, args, props, body)
        except errors.AMQPError as exc:
            if not exc.class_id:  # the failing method is basic.publish, whichever path parsed it
                exc.class_id, exc.method_id = 60, 40
            raise
        except (errors.DiskFull, OSError) as exc:
            self._not_stored(chs, exc, len(body))

    def _publish(self, chs: ChannelState, args: PublishArgs, props: bytes,
                 body: bytes | memoryview) -> PublishOutcome:
        """One publish through the model's publish operation, answered in AMQP."""
        vh = self.vh
        assert vh is not None
        stats = self.stats
        stats.published += 1
        chs.n_published += 1
        stats.sizes.observe(len(body))
        flags = props[0] if props else 0
        if flags & HI_REPLY_TO:  # may need rewriting for direct reply-to
            props = self._rewrite_reply_to(chs, props)
        exchange = args.exchange
        ex = vh.exchanges.get(exchange)
        if ex is None or ex.internal or exchange not in self._write_ok:
            self._may_publish_to(exchange, args.routing_key)
        # persistence (delivery-mode) is read by the publish operation, only if a durable queue is reached
        out = vh.publish(PublishRequest(exchange, args.routing_key, props, body, self.now_ms, None, args,
                                        None, True, chs.origin))  # origin: the firehose's publish copy
        if out.queues:
            for q in out.queues:
                if q.consumers:
                    self.batch_queues.add(q)
            if out.rejected:
                self.publish_rejected(chs)  # x-overflow reject-publish: a nack
        elif not out.held:
            self._unroutable(chs, args, props, body)
        if out.sync and chs.confirm:
            chs.needs_sync = True
            _depend_on(chs, out.queues, out.held)
        return out

    def _unroutable(self, chs: ChannelState, args: PublishArgs, props: bytes,
                    body: bytes | memoryview) -> None:
        """A publish that reached no queue: a direct reply-to, or counted and, if mandatory,
        returned (basic.return, 312 NO_ROUTE)."""
        vh = self.vh
        assert vh is not None
        routing_key = args.routing_key
        if args.exchange == "" and routing_key.startswith(REPLY_TO_PREFIX) and self._direct_reply(
                routing_key, "", props, bytes(body)):
            return
        self.stats.unroutable += 1
        vh.n_unroutable += 1
        if args.mandatory:
            self.stats.returned += 1
            vh.n_returned += 1
            self.out += codec.encode_return(chs.id, 312, b"NO_ROUTE", args.exchange_b, args.routing_key_b,
                                            props, bytes(body), self.frame_max)

    def _check_user_id(self, props: bytes) -> None:
        """RabbitMQ's validated user-id: a user_id property must name the connection's user,
        unless the user has the ``impersonator`` tag (looked up now: a tag change applies to
        open connections, as in RabbitMQ)."""
        uid = properties.decode(props).user_id
        if uid is not None and uid != self.username and not self._impersonator():
            raise errors.PreconditionFailed(f"user_id property set to '{uid}' but authenticated user "
                                            f"was '{self.username}'", 60, 40)

    def _impersonator(self) -> bool:
        user = self.broker.users.resolve(self._who)  # a token's tags are its scopes', not a namesake's
        return user is not None and "impersonator" in user.tags

    def _may_publish_to(self, exchange: str, routing_key: str) -> None:
        """404 for a missing exchange, 403 for an internal one, without write permission, or
        for a routing key the user's topic permission on a topic exchange does not allow. The
        permission is remembered once granted, unless a topic permission applies: then every
        publish comes here (``_write_ok`` is what lets runs and batches skip the check)."""
        vh = self.vhost_obj
        ex = vh.get_exchange(exchange)
        if ex.internal:
            raise errors.AccessRefused(f"cannot publish to internal exchange '{exchange}'", 60, 40)
        self._check("write", exchange, "exchange")
        if self._topic_checked(ex.type, exchange, routing_key, "write"):
            return
        self._write_ok.add(exchange)

    def _topic_checked(self, kind: str, exchange: str, routing_key: str, action: str) -> bool:
        """RabbitMQ's topic authorisation on a topic exchange: 403 unless the user's topic
        permission there (if any) lets ``routing_key`` through for ``action`` (write: publish,
        read: bind and unbind). True when a topic permission applied."""
        users = self.broker.users
        if kind != "topic" or not users.has_topic_permission(self._who, self.vhost, exchange):
            return False
        if not users.topic_allows(self._who, self.vhost, exchange, action, routing_key):
            raise errors.AccessRefused(f"access to topic '{routing_key}' in exchange '{exchange}' in "
                                       f"vhost '{self.vhost}' refused for user '{self.username}'")
        return True

    def handle_publish_run(self, channel: int, args: PublishArgs, props: list[bytes], bodies: list[bytes],
                           same: bool) -> None:
        """A run of publishes to one exchange and routing key: the publish operation takes it
        as a run when that is the same as publishing them one by one (its decision,
        ``VHost.publish_run``); otherwise, and for what is AMQP's own (transactions,
        direct reply-to, a first publish to an exchange), one by one from the first on."""
        chs = self.chs[channel]
        vh = self.vh
        exchange = args.exchange
        ex = None if vh is None else vh.exchanges.get(exchange)
        flags = None if same else properties.run_flags(props)
        if ex is None or ex.internal or chs.tx is not None or exchange not in self._write_ok \
                or (vh is not None and vh.meta.tracing) \
                or (props[0][0] & HI_REPLY_TO or props[0][1] & FLAG_USER_ID if flags is None
                    else flags & (FLAG_REPLY_TO | FLAG_USER_ID)):
            self.publish_each(channel, args, props, bodies)
            return
        try:
            out = self.vhost_obj.publish_run(exchange, args.routing_key, args, props, bodies, same,
                                             self.now_ms, flags)
        except (errors.DiskFull, OSError) as exc:
            if not errors.no_space(exc):
                raise
            # one by one then: each is refused (nacked) or stored on its own (the run reserved
            # its room in every queue first, so none of it is stored yet)
            out = None
        if out is None:
            self.publish_each(channel, args, props, bodies)
            return
        self._published(chs, bodies, 0, len(bodies), out.queues, out.sync, same)

    def _published(self, chs: ChannelState, bodies: list[bytes], lo: int, hi: int, queues: list[Queue],
                   sync: bool, same: bool = False) -> None:
        """Count the publishes ``bodies[lo:hi]`` on ``chs`` that the publish operation took at
        once (a run or a batch; ``same``: bodies of one length): statistics, confirm sequence
        numbers, the queues to wake, the sync flag."""
        k = hi - lo
        chs.n_published += k
        if chs.confirm:
            chs.publish_seq += k
            self._confirm_dirty.add(chs)
        else:
            self.unanswered = True
            chs.publishing = True
        self._count_published(bodies, lo, hi, queues, same)
        if sync and chs.confirm:
            chs.needs_sync = True
            _depend_on(chs, queues, False)

    def _count_published(self, bodies: list[bytes], lo: int, hi: int, queues: list[Queue],
                         same: bool = False) -> None:
        """The connection's side of ``_published``: statistics and the queues to wake."""
        k = hi - lo
        self.batch_publishes += k
        stats = self.stats
        stats.published += k
        stats.sizes.observe_run(bodies, lo, hi, same)
        for q in queues:
            if q.consumers:
                self.batch_queues.add(q)

    def mixes_publishes(self, channel: int) -> bool:
        chs = self.chs.get(channel)
        return chs is not None and not chs.confirm and chs.tx is None

    def handle_publish_mixed(self, channels: list[int], args: list[PublishArgs], props: list[bytes],
                             bodies: list[bytes]) -> None:
        """Publishes in a row to one exchange on channels without confirms or transactions,
        each on its own (issue 31's producer with a channel per queue): the publish operation
        takes them at once as ``handle_publish_batch``'s are (``VHost.publish_batch``: what it
        does with a message does not depend on the channel it came on). Per channel there is
        only counting left. Whatever is AMQP's own, or may fail (the exchange and the permission
        to write to it not yet seen on this connection), goes one by one, each on its channel."""
        vh = self.vh
        exchange = args[0].exchange
        ex = None if vh is None else vh.exchanges.get(exchange)
        if vh is None or ex is None or ex.internal or exchange not in self._write_ok or vh.meta.tracing \
                or properties.run_flags(props) & (FLAG_REPLY_TO | FLAG_USER_ID):
            self.publish_each_mixed(channels, args, props, bodies)
            return
        chs_of = self.chs
        i, k = 0, len(bodies)
        while i < k:
            out = self._batch_from(vh, exchange, args, props, bodies, i)
            if out is None:
                self.publish_each_mixed(channels, args, props, bodies, i)
                return
            if out.done > i:
                self.unanswered = True
                for j in range(i, out.done):
                    chs = chs_of[channels[j]]
                    chs.n_published += 1
                    chs.publishing = True
                self._count_published(bodies, i, out.done, out.queues)
                for j in out.unroutable:
                    self._unroutable(chs_of[channels[j]], args[j], props[j], bodies[j])
                i = out.done
            if i < k:  # the next one on its own; if it closes its channel, the rest one by one too
                ch = channels[i]
                if not self.publish_each_mixed(channels, args, props, bodies, i, i + 1):
                    return
                i += 1
                if self.channels.get(ch) != CH_OPEN:
                    self.publish_each_mixed(channels, args, props, bodies, i)
                    return

    def _batch_from(self, vh: VHost, exchange: str, args: list[PublishArgs], props: list[bytes],
                    bodies: list[bytes], first: int) -> BatchOutcome | None:
        """``VHost.publish_batch`` from ``first``; None when the disk is full: nothing of the
        batch is stored then (room first), and the caller publishes it one by one, each refused
        or stored."""
        try:
            return vh.publish_batch(exchange, args, props, bodies, self.now_ms, first)
        except (errors.DiskFull, OSError) as exc:
            if not errors.no_space(exc):
                raise
            return None

    def handle_publish_batch(self, channel: int, args: list[PublishArgs], props: list[bytes],
                             bodies: list[bytes]) -> None:
        """Publishes in a row to one exchange with routing keys of their own: the publish
        operation takes them at once as far as that is the same as one by one
        (``VHost.publish_batch``); a message it leaves, and whatever is AMQP's own (as for
        ``handle_publish_run``), is published alone, in its place in the order."""
        chs = self.chs[channel]
        vh = self.vh
        if vh is None or chs.tx is not None or vh.meta.tracing \
                or properties.run_flags(props) & (FLAG_REPLY_TO | FLAG_USER_ID):
            self.publish_each(channel, args, props, bodies)
            return
        exchange = args[0].exchange
        ex = vh.exchanges.get(exchange)
        i = 0
        if ex is None or ex.internal or exchange not in self._write_ok:
            # the first on its own: it finds the exchange and the permission to write to it,
            # or fails (and the channel closes)
            if not self.publish_each(channel, args, props, bodies, 0, 1):
                return
            i = 1
            if exchange not in self._write_ok:  # a topic permission: each routing key is checked
                self.publish_each(channel, args, props, bodies, 1, len(bodies))
                return
        k = len(bodies)
        while i < k:
            out = self._batch_from(vh, exchange, args, props, bodies, i)
            if out is None:
                self.publish_each(channel, args, props, bodies, i)
                return
            if out.done > i:
                self._published(chs, bodies, i, out.done, out.queues, out.sync)
                for j in out.unroutable:
                    self._unroutable(chs, args[j], props[j], bodies[j])
                i = out.done
            if i < k:  # the next one on its own
                if not self.publish_each(channel, args, props, bodies, i, i + 1):
                    return
                i += 1

    def _not_stored(self, chs: ChannelState, exc: errors.DiskFull | OSError, need: int) -> None:
        """The current publish found no disk space (the store wrote it nowhere, or to some of
        its queues only): raise the disk alarm at once, which blocks every publisher, and tell
        this one: a basic.nack in confirm mode, else a channel error. Never a connection
        error: the broker is fine, only the disk is full."""
        if not errors.no_space(exc):
            raise exc
        self.broker.alarm.disk_full(need, self.broker.connections)
        if chs.confirm:
            self.publish_rejected(chs)
            return
        raise errors.PreconditionFailed("disk full: message not stored; publishers are blocked until "
                                        "space is available", 60, 40) from None

    def publishes_in_flight(self) -> bool:
        """Whether this client may be sending more publishes while we work: it published
        without confirms in this read batch (we cannot see where such a stream ends), or it
        waits for confirms or a deferred reply (tx.commit-ok). A client with nothing in flight
        waits for us, so holding its reads back (net/server.py) would only add latency."""
        if self.unanswered:
            return True
        for chs in self.chs.values():
            if chs.publish_seq != chs.confirmed or chs.deferred is not None:
                return True
        return False

    def _rewrite_reply_to(self, chs: ChannelState, props: bytes) -> bytes:
        p = properties.decode(props)
        if p.reply_to != REPLY_TO:
            return props
        if chs.reply_token is None:
            raise errors.PreconditionFailed("fast reply consumer does not exist", 60, 40)
        p.reply_to = REPLY_TO_PREFIX + chs.reply_token
        return properties.encode(p)

    def _direct_reply(self, routing_key: str, exchange: str, props: bytes, body: bytes) -> bool:
        target = self.broker.reply_to.get(routing_key[len(REPLY_TO_PREFIX):])
        if target is None:
            return False
        session, chs = target
        if not chs.open or chs.reply_tag is None:
            return False
        tag = chs.next_tag
        chs.next_tag += 1
        chs.n_deliver_no_ack += 1  # a direct reply-to consumer takes no acks
        prefix = codec.METHOD_ID.pack(0x003C003C) + codec.shortstr(chs.reply_tag.encode())
        session.out += codec.encode_delivery(chs.id, prefix, tag, False, exchange.encode(),
                                             routing_key.encode(), props, body, session.frame_max)
        session.wakeup()
        return True

    def after_batch(self) -> None:
        """Called by the network layer after each read batch: coalesced confirms."""
        if self._confirm_dirty:
            dirty = self._confirm_dirty
            self._confirm_dirty = set()
            for chs in dirty:
                self._flush_confirms(chs)

    def _flush_confirms(self, chs: ChannelState) -> None:
        if not chs.open or chs.sync_waiting or chs.publish_seq == chs.confirmed:
            return
        if chs.needs_sync and self.broker.syncer.enabled:
            chs.needs_sync = False
            chs.sync_waiting = True
            target = chs.publish_seq
            deps, chs.sync_deps = chs.sync_deps, set()

            def done(ok: bool) -> None:
                chs.sync_waiting = False
                if not chs.open:
                    return
                self._send_confirm(chs, target, nack=not ok)
                self._flush_confirms(chs)
                if self.flush_now is not None:
                    self.flush_now()  # now: a synchronous publisher waits for nothing else
                else:
                    self.wakeup()

            self.broker.syncer.after_sync(done, deps)
            return
        chs.needs_sync = False
        chs.sync_deps = set()
        self._send_confirm(chs, chs.publish_seq)

    def publish_rejected(self, chs: ChannelState) -> None:
        """A queue refused the current publish: its confirm becomes a basic.nack."""
        if chs.confirm:
            if chs.nacks is None:
                chs.nacks = []
            if not chs.nacks or chs.nacks[-1] != chs.publish_seq:
                chs.nacks.append(chs.publish_seq)

    def _send_confirm(self, chs: ChannelState, upto: int, nack: bool = False) -> None:
        if upto <= chs.confirmed:
            return
        if chs.nacks is not None:  # acks up to each refused publish, then a nack for it
            due = [n for n in chs.nacks if n <= upto]
            chs.nacks = [n for n in chs.nacks if n > upto] or None
            for n in due:
                if n > chs.confirmed:
                    self._send_confirm(chs, n - 1, nack)
                    chs.confirmed = n
                    self.out += codec.encode_confirm(chs.id, n, False, True)
            if upto <= chs.confirmed:
                return
        n = upto - chs.confirmed
        chs.confirmed = upto
        self.out += codec.encode_confirm(chs.id, upto, n > 1, nack)
        if not nack:
            self.broker.stats.confirmed += n  # messages, not frames (one ack covers many)
            if self.vh is not None:
                self.vh.n_confirmed += n

    # -------------------------------------------------------------------- acks
    def handle_ack(self, channel: int, delivery_tag: int, multiple: bool) -> None:
        chs = self.chs[channel]
        if chs.tx is not None:
            self._settle(chs, delivery_tag, multiple, None, dry_run=True)
            chs.tx.append(("ack", delivery_tag, multiple))
            return
        self._settle(chs, delivery_tag, multiple, None)

    def _settle(self, chs: ChannelState, tag: int, multiple: bool, requeue: bool | None,
                dry_run: bool = False) -> None:
        """Ack (requeue None) or reject/nack (requeue True/False) deliveries."""
        unacked = chs.unacked
        if multiple:
            if tag == 0:
                tags = list(unacked)
            else:
                tags = []
                for t in unacked:
                    if t > tag:
                        break
                    tags.append(t)
            if tag and not tags and tag >= chs.next_tag:
                raise errors.PreconditionFailed(f"unknown delivery tag {tag}", *_settle_ids(requeue))
        else:
            if tag not in unacked:
                raise errors.PreconditionFailed(f"unknown delivery tag {tag}", *_settle_ids(requeue))
            tags = [tag]
        if dry_run:
            return
        if requeue is None:
            self._ack_tags(chs, tags)
            return
        touched: Queue | None = None
        for t in tags:
            q, msgid, c = unacked.pop(t)
            q.reject(msgid, requeue)
            if c is not None:
                c.unacked -= 1
            if touched is not q:
                touched = q
                q.schedule_delivery()
        self._released(chs, len(tags))

    def handle_ack_run(self, channel: int, tags: list[int]) -> int:
        """Single acks of ``tags`` (Connection._ack_run) as one batch: the longest prefix of them
        that are unacked and not repeated is acked at once; the rest is the caller's."""
        chs = self.chs[channel]
        if chs.tx is not None:
            return 0  # a transaction records each ack: the ordinary path
        unacked = chs.unacked
        good = 0
        for t in tags:
            if t not in unacked:
                break
            good += 1
        if good and len(set(tags[:good])) != good:  # a tag repeated: only up to its first repeat
            seen: set[int] = set()
            for i, t in enumerate(tags[:good]):
                if t in seen:
                    good = i
                    break
                seen.add(t)
        if good:
            self._ack_tags(chs, tags[:good])
        return good

    def _ack_tags(self, chs: ChannelState, tags: list[int]) -> None:
        """Ack ``tags`` (all unacked on ``chs``), the store work batched per queue (a multiple
        ack, or a run of single ones, is nearly always one queue)."""
        unacked = chs.unacked
        touched: Queue | None = None
        batch: list[int] = []
        for t in tags:
            q, msgid, c = unacked.pop(t)
            if c is not None:
                c.unacked -= 1
            if touched is not q:
                if batch:
                    touched.ack_many(batch)  # type: ignore[union-attr]
                    batch = []
                touched = q
                q.schedule_delivery()
            batch.append(msgid)
        if batch and touched is not None:
            touched.ack_many(batch)
        self.stats.acked += len(tags)
        chs.n_acked += len(tags)
        self._released(chs, len(tags))

    def _released(self, chs: ChannelState, n: int) -> None:
        """``n`` deliveries of ``chs`` were settled: its prefetch has room for them again."""
        chs.unacked_count -= n
        if chs.global_prefetch:
            # capacity shared by the channel: every consumer on it may take more now
            for c in chs.consumers.values():
                c.queue.schedule_delivery()

    # ------------------------------------------------------------- the rest
    def handle_method(self, channel: int, method: PFrame) -> None:
        chs = self.chs[channel]
        handler = _HANDLERS.get(type(method))
        if handler is None:
            raise errors.AMQPNotImplemented(f"{method.name} is not implemented")
        if type(method) in _QUEUE_NAMED and not getattr(method, "queue", "x"):
            _expand_empty_queue(chs, method)
        try:
            handler(self, chs, method)
        except (errors.DiskFull, OSError) as exc:
            # a durable declare, a tx.commit's publishes...: the channel fails, not the connection
            if not errors.no_space(exc):
                raise
            self.broker.alarm.disk_full(1, self.broker.connections)
            raise errors.PreconditionFailed(f"disk full: {method.name} failed; publishers are blocked "
                                            "until space is available", method.index >> 16,
                                            method.index & 0xFFFF) from None

    # exchange.*
    def _exchange_declare(self, chs: ChannelState, m: commands.Exchange.Declare) -> None:
        vh = self.vhost_obj
        if not m.exchange:  # even a passive declare, as RabbitMQ
            raise errors.AccessRefused("operation not permitted on the default exchange")
        if not m.passive:
            self._check("configure", m.exchange, "exchange")
        ex_before = m.exchange in vh.exchanges
        vh.declare_exchange(m.exchange, m.exchange_type, passive=m.passive, durable=m.durable,
                            auto_delete=m.auto_delete, internal=m.internal,
                            arguments=dict(m.arguments or {}))
        if not m.nowait:
            if m.durable and not ex_before and not m.passive:
                self.reply_after_sync(chs, commands.Exchange.DeclareOk(), (vh.definitions,))
            else:
                self.reply(chs, commands.Exchange.DeclareOk())

    def _exchange_delete(self, chs: ChannelState, m: commands.Exchange.Delete) -> None:
        self._check("configure", m.exchange, "exchange")
        self.vhost_obj.delete_exchange(m.exchange, if_unused=m.if_unused)
        if not m.nowait:
            self.reply(chs, commands.Exchange.DeleteOk())

    def _exchange_bind(self, chs: ChannelState, m: commands.Exchange.Bind) -> None:
        self._exchange_binding(chs, m, True)

    def _exchange_unbind(self, chs: ChannelState, m: commands.Exchange.Unbind) -> None:
        self._exchange_binding(chs, m, False)

    def _exchange_binding(self, chs: ChannelState, m: commands.Exchange.Bind | commands.Exchange.Unbind,
                          bind: bool) -> None:
        self._check("write", m.destination, "exchange")
        self._check("read", m.source, "exchange")
        self._binding_topic(m.source, m.routing_key)
        op = self.vhost_obj.bind_exchange if bind else self.vhost_obj.unbind_exchange
        op(m.destination, m.source, m.routing_key, dict(m.arguments or {}))
        if not m.nowait:
            self.reply(chs, commands.Exchange.BindOk() if bind else commands.Exchange.UnbindOk())

    def _binding_topic(self, source: str, routing_key: str) -> None:
        ex = self.vhost_obj.exchanges.get(source)
        if ex is not None:
            self._topic_checked(ex.type, source, routing_key, "read")

    # queue.*
    def _queue_declare(self, chs: ChannelState, m: commands.Queue.Declare) -> None:
        vh = self.vhost_obj
        if not m.passive and m.queue:
            self._check("configure", m.queue)
        q, created = vh.declare_queue(m.queue, passive=m.passive, durable=m.durable,
                                      exclusive=m.exclusive, auto_delete=m.auto_delete,
                                      arguments=dict(m.arguments or {}), owner=self)
        chs.last_queue = q.name
        if m.nowait:
            return
        ok = methods.QueueDeclareOk(queue=q.name, message_count=q.message_count,  # any UTF-8 name
                                    consumer_count=q.consumer_count)
        if created and q.durable and q.exclusive_owner is None:
            self.reply_after_sync(chs, ok, (vh.definitions,))
        else:
            self.reply(chs, ok)

    def _queue_bind(self, chs: ChannelState, m: commands.Queue.Bind) -> None:
        self._check("write", m.queue)
        self._check("read", m.exchange, "exchange")
        self._binding_topic(m.exchange, m.routing_key)
        self.vhost_obj.bind_queue(m.queue, m.exchange, m.routing_key, dict(m.arguments or {}), self)
        if not m.nowait:
            self.reply(chs, commands.Queue.BindOk())

    def _queue_unbind(self, chs: ChannelState, m: commands.Queue.Unbind) -> None:
        self._check("write", m.queue)
        self._check("read", m.exchange, "exchange")
        self._binding_topic(m.exchange, m.routing_key)
        self.vhost_obj.unbind_queue(m.queue, m.exchange, m.routing_key, dict(m.arguments or {}), self)
        self.reply(chs, commands.Queue.UnbindOk())

    def _queue_purge(self, chs: ChannelState, m: commands.Queue.Purge) -> None:
        self._check("read", m.queue)
        q = self.vhost_obj.get_queue(m.queue, self)
        n = q.purge()
        if not m.nowait:
            if self.broker.syncer.synchronous:  # purge-ok once the purge is on disk
                self.reply_after_sync(chs, commands.Queue.PurgeOk(message_count=n), (q.store,))
            else:
                self.reply(chs, commands.Queue.PurgeOk(message_count=n))

    def _queue_delete(self, chs: ChannelState, m: commands.Queue.Delete) -> None:
        self._check("configure", m.queue)
        held: list[tuple[ChannelState, commands.Basic.Cancel]] = []
        self.held_cancels = held
        try:
            n = self.vhost_obj.delete_queue(m.queue, if_unused=m.if_unused, if_empty=m.if_empty, owner=self)
        finally:
            self.held_cancels = None
        if not m.nowait:
            self.reply(chs, commands.Queue.DeleteOk(message_count=n))
        for cchs, cancel in held:  # RabbitMQ: delete-ok first, then the consumers' basic.cancel
            if cchs.open:
                self.reply(cchs, cancel)

    # basic.*
    def _basic_qos(self, chs: ChannelState, m: commands.Basic.Qos) -> None:
        if m.prefetch_size:
            raise errors.AMQPNotImplemented("prefetch_size != 0 is not supported")
        if m.global_:
            chs.global_prefetch = m.prefetch_count
        else:
            chs.prefetch = m.prefetch_count
        self.reply(chs, commands.Basic.QosOk())
        for c in chs.consumers.values():
            c.queue.schedule_delivery()

    def _basic_consume(self, chs: ChannelState, m: commands.Basic.Consume) -> None:
        tag = m.consumer_tag or "amq.ctag-" + base64.urlsafe_b64encode(os.urandom(16)).decode().rstrip("=")
        if tag in chs.consumers or tag == chs.reply_tag:
            raise errors.NotAllowed(f"attempt to reuse consumer tag '{tag}'")
        if m.queue == REPLY_TO:
            if not m.no_ack:
                raise errors.PreconditionFailed("reply consumer cannot acknowledge")
            if chs.reply_tag is not None:
                raise errors.PreconditionFailed("reply consumer already set")
            chs.reply_token = base64.urlsafe_b64encode(os.urandom(18)).decode()
            chs.reply_tag = tag
            self.broker.reply_to[chs.reply_token] = (self, chs)
            if not m.nowait:
                self.reply(chs, commands.Basic.ConsumeOk(consumer_tag=tag))
            return
        self._check("read", m.queue)
        q = self.vhost_obj.get_queue(m.queue, self)
        # the queue type's own rules: 540 for a global prefetch on quorum, a stream's 406s
        q.check_consume(m.no_ack, chs.prefetch, chs.global_prefetch, dict(m.arguments or {}))
        if m.exclusive and q.consumers:
            raise errors.AccessRefused(f"queue '{q.name}' in vhost '{q.vhost}' in exclusive use")
        if any(c.exclusive for c in q.consumers):
            raise errors.AccessRefused(f"queue '{q.name}' in vhost '{q.vhost}' in exclusive use")
        c = SessionConsumer(self, chs, tag, q, m.no_ack, m.exclusive, dict(m.arguments or {}))
        chs.consumers[tag] = c
        if not m.nowait:
            self.reply(chs, commands.Basic.ConsumeOk(consumer_tag=tag))
        q.add_consumer(c)

    def _basic_cancel(self, chs: ChannelState, m: commands.Basic.Cancel) -> None:
        c = chs.consumers.pop(m.consumer_tag or "", None)
        if c is not None:
            c.queue.remove_consumer(c)
        elif m.consumer_tag == chs.reply_tag and chs.reply_token is not None:
            self.broker.reply_to.pop(chs.reply_token, None)
            chs.reply_tag = None
        if not m.nowait:
            self.reply(chs, commands.Basic.CancelOk(consumer_tag=m.consumer_tag))

    def _basic_get(self, chs: ChannelState, m: commands.Basic.Get) -> None:
        self._check("read", m.queue)
        q = self.vhost_obj.get_queue(m.queue, self)
        got = None if q.paused else q.get()  # paused: nothing leaves it (LavinMQ)
        if got is None:
            self.broker.stats.gets_empty += 1
            self.reply(chs, commands.Basic.GetEmpty())
            return
        msgid, exchange, routing_key, props, body, redelivered = got
        tag = chs.next_tag
        chs.next_tag += 1
        if m.no_ack:
            q.ack(msgid)
            q.n_gets_no_ack += 1
            self.broker.stats.gets_autoack += 1
            chs.n_get_no_ack += 1
        else:
            chs.unacked[tag] = (q, msgid, None)
            chs.unacked_count += 1
            chs.n_get += 1
        if redelivered:
            chs.n_redelivered += 1
        data = codec.encode_get_ok(chs.id, tag, redelivered, exchange, routing_key, q.message_count,
                                   props, body, self.frame_max)
        vh = self.vhost_obj
        if vh.meta.tracing:  # firehose: a get is a delivery too
            trace.delivered(vh, chs.origin, q.name, exchange, routing_key, props, body, redelivered,
                            self.now_ms)
        if chs.deferred is not None:
            chs.deferred.append(data)
        else:
            self.out += data
        self.broker.stats.delivered += 1
        self.broker.stats.gets += 1

    def _basic_reject(self, chs: ChannelState, m: commands.Basic.Reject) -> None:
        if chs.tx is not None:
            self._settle(chs, m.delivery_tag or 0, False, m.requeue, dry_run=True)
            chs.tx.append(("reject", m.delivery_tag or 0, False, m.requeue))
            return
        self._settle(chs, m.delivery_tag or 0, False, m.requeue)

    def _basic_nack(self, chs: ChannelState, m: commands.Basic.Nack) -> None:
        if chs.tx is not None:
            self._settle(chs, m.delivery_tag, m.multiple, m.requeue, dry_run=True)
            chs.tx.append(("reject", m.delivery_tag, m.multiple, m.requeue))
            return
        self._settle(chs, m.delivery_tag, m.multiple, m.requeue)

    def _basic_ack(self, chs: ChannelState, m: commands.Basic.Ack) -> None:
        self.handle_ack(chs.id, m.delivery_tag, m.multiple)

    def _basic_recover(self, chs: ChannelState, m: commands.Basic.Recover) -> None:
        if not m.requeue:
            # As RabbitMQ: redelivering to the same consumer only (the spec's requeue=false)
            # is not offered; clients use requeue=true.
            raise errors.AMQPNotImplemented("requeue=false")
        self._requeue_all(chs)
        for c in chs.consumers.values():
            c.queue.schedule_delivery()
        if isinstance(m, commands.Basic.Recover):
            self.reply(chs, commands.Basic.RecoverOk())

    # confirm / tx / channel.flow
    def _confirm_select(self, chs: ChannelState, m: commands.Confirm.Select) -> None:
        if chs.tx is not None:
            raise errors.PreconditionFailed("cannot switch from tx to confirm mode")
        chs.confirm = True
        if not m.nowait:
            self.reply(chs, commands.Confirm.SelectOk())

    def _tx_select(self, chs: ChannelState, m: commands.Tx.Select) -> None:
        if chs.confirm:
            raise errors.PreconditionFailed("cannot switch from confirm to tx mode")
        if chs.tx is None:
            chs.tx = []
        self.reply(chs, commands.Tx.SelectOk())

    def _tx_commit(self, chs: ChannelState, m: commands.Tx.Commit) -> None:
        if chs.tx is None:
            raise errors.PreconditionFailed("channel is not transactional")
        vh = self.vhost_obj
        for op in chs.tx:  # refusals first (an exchange deleted since, a revoked permission):
            if op[0] == "publish":  # an error must leave the whole commit undone
                exchange = op[1].exchange
                ex = vh.exchanges.get(exchange)
                if ex is None or ex.internal or exchange not in self._write_ok:
                    self._may_publish_to(exchange, op[1].routing_key)  # with its topic permission
        ops, chs.tx = chs.tx, []
        stores: set[Any] | None = set()  # what the commit wrote: only their failure fails it
        for op in ops:
            if op[0] == "publish":
                out = self._publish(chs, op[1], op[2], op[3])
                if out.held:
                    stores = None
                elif stores is not None:
                    stores.update(q.store for q in out.queues)
            else:
                if stores is not None:  # every queue the channel holds messages of: a superset
                    stores.update(q.store for q, _m, _c in chs.unacked.values())
                self._settle_lenient(chs, op[1], op[2], None if op[0] == "ack" else op[3])
        self.reply_after_sync(chs, commands.Tx.CommitOk(), stores)

    def _settle_lenient(self, chs: ChannelState, tag: int, multiple: bool, requeue: bool | None) -> None:
        try:
            self._settle(chs, tag, multiple, requeue)
        except errors.PreconditionFailed:
            pass  # settled earlier in the same transaction

    def _tx_rollback(self, chs: ChannelState, m: commands.Tx.Rollback) -> None:
        if chs.tx is None:
            raise errors.PreconditionFailed("channel is not transactional")
        chs.tx = []
        self.reply(chs, commands.Tx.RollbackOk())

    def _channel_flow(self, chs: ChannelState, m: commands.Channel.Flow) -> None:
        chs.flow = bool(m.active)
        self.reply(chs, commands.Channel.FlowOk(active=chs.flow))
        if chs.flow:
            for c in chs.consumers.values():
                c.queue.schedule_delivery()

    def _channel_flow_ok(self, chs: ChannelState, m: commands.Channel.FlowOk) -> None:
        pass

    # ------------------------------------------------------------ net events
    def set_writable(self, writable: bool) -> None:
        self.writable = writable
        if writable:
            for chs in self.chs.values():
                for c in chs.consumers.values():
                    c.queue.schedule_delivery()

    def channel_is_open(self, ch: int) -> bool:
        return self.channels.get(ch) == CH_OPEN


_HANDLERS: dict[type, Callable[[Session, ChannelState, Any], None]] = {
    commands.Exchange.Declare: Session._exchange_declare,
    commands.Exchange.Delete: Session._exchange_delete,
    commands.Exchange.Bind: Session._exchange_bind,
    commands.Exchange.Unbind: Session._exchange_unbind,
    commands.Queue.Declare: Session._queue_declare,
    commands.Queue.Bind: Session._queue_bind,
    commands.Queue.Unbind: Session._queue_unbind,
    commands.Queue.Purge: Session._queue_purge,
    commands.Queue.Delete: Session._queue_delete,
    commands.Basic.Qos: Session._basic_qos,
    commands.Basic.Consume: Session._basic_consume,
    commands.Basic.Cancel: Session._basic_cancel,
    commands.Basic.Get: Session._basic_get,
    commands.Basic.Ack: Session._basic_ack,
    commands.Basic.Reject: Session._basic_reject,
    commands.Basic.Nack: Session._basic_nack,
    commands.Basic.Recover: Session._basic_recover,
    commands.Basic.RecoverAsync: Session._basic_recover,
    commands.Confirm.Select: Session._confirm_select,
    commands.Tx.Select: Session._tx_select,
    commands.Tx.Commit: Session._tx_commit,
    commands.Tx.Rollback: Session._tx_rollback,
    commands.Channel.Flow: Session._channel_flow,
    commands.Channel.FlowOk: Session._channel_flow_ok,
}


def _settle_ids(requeue: bool | None) -> tuple[int, int]:
    """Class/method ids for an unknown-tag refusal: basic.ack's for an ack (its fast path has no
    method to name), else none, so handle_method names the reject or nack that failed."""
    return (60, 80) if requeue is None else (0, 0)


# Methods whose empty queue name means the channel's last declared queue (spec; RabbitMQ too).
_QUEUE_NAMED = (commands.Queue.Bind, commands.Queue.Unbind, commands.Queue.Purge, commands.Queue.Delete,
                commands.Basic.Consume, commands.Basic.Get)


def _expand_empty_queue(chs: ChannelState, method: PFrame) -> None:
    if not chs.last_queue:
        raise errors.NotFound("no previously declared queue")
    if isinstance(method, commands.Queue.Bind) and not method.routing_key:
        method.routing_key = chs.last_queue  # an empty key with it: the queue's name (RabbitMQ)
    method.queue = chs.last_queue  # type: ignore[attr-defined]


def _depend_on(chs: ChannelState, queues: Sequence[Queue], held: bool) -> None:
    """The confirms waiting on ``chs`` depend on these queues' stores too; a message an
    exchange holds (delayed) on its own store, which the channel does not see: on any."""
    deps = chs.sync_deps
    if deps is None:
        return
    if held:
        chs.sync_deps = None
        return
    for q in queues:
        deps.add(q.store)


def _answer_of(method: PFrame) -> str:
    """The method a deferred answer answers (``Tx.CommitOk`` -> ``tx.commit``), for an error."""
    name = str(method.name)
    return (name[:-2] if name.endswith("Ok") else name).lower()
