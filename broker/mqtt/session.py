"""One MQTT connection turned into the model's operations: publish, queues, consume, settle.

Theory of operation
-------------------
MQTT is mapped onto the core the way RabbitMQ maps it (names and properties: ``mapping.py``),
so AMQP and MQTT clients meet:

- **Publish.** A PUBLISH goes through the one publish operation (``VHost.publish``) to the
  MQTT exchange (``[mqtt] exchange``, default ``amq.topic``). A QoS 1 PUBLISH is answered
  (PUBACK) only once the message is as durable as an AMQP publisher confirm makes it (the group
  commit, the in-sync followers in a cluster): the answers wait in the syncer's queue of
  callbacks, which keeps them in order. One that reached no durable store (only clean
  sessions' queues, or none) is answered at once, as an AMQP confirm is, unless an earlier
  answer still waits there (it then waits behind it). A QoS 2 PUBLISH is stored once and answered with PUBREC;
  its packet identifier is remembered until PUBREL, so a resent PUBLISH is not stored twice.
- **Subscriptions are queues.** A session's subscriptions are bindings of its queues to the MQTT
  exchange: ``mqtt-subscription-<client id>qos0`` for QoS 0 filters, ``...qos1`` for QoS 1 and 2
  (QoS 2 is granted as 1, as RabbitMQ does), named as RabbitMQ names them. A session that ends
  with the connection (3.1.1 clean session, MQTT 5 session expiry 0) has exclusive queues; one
  that outlives it has durable queues (MQTT 5: with ``x-expires`` of its session expiry), so its
  subscriptions and QoS 1 messages survive the client's absence, a restart, kill -9 and a
  failover, and CONNACK says ``session present`` when they exist.
- **Delivery.** The session consumes from its queues with ``MQTTConsumer``: QoS 0 deliveries are
  settled when written; QoS 1 deliveries take a packet identifier and stay unacked in the queue
  until PUBACK, at most ``[mqtt] prefetch`` at a time (and the client's receive maximum), and come
  back to the queue when the connection ends. The delivered QoS is the lower of the queue's and
  the message's. MQTT 5 options are applied per delivery against the session's filters that
  match the topic: subscription identifiers, no-local, retain-as-published; a message larger
  than the client's maximum packet size is dropped, as the spec says.
- **Retained messages** (``retained.py``): a PUBLISH with the retain flag is stored as its
  topic's retained message before it is published (an empty payload clears it), durable by the
  same group commit its PUBACK waits for; a subscription is sent the retained messages its filter
  matches, wildcards included, right after SUBACK (MQTT 5 retain handling decides whether).
- **Authentication and permissions** are AMQP's: the adapter logs the CONNECT's user in through
  the same users and login throttle before ``start``; a user name ``vhost:user`` picks the vhost.
  Publishing needs write on the exchange; a subscription needs configure, write and read on its
  queue and read on the exchange, checked per filter; a topic permission on the exchange
  (RabbitMQ's topic authorisation) applies to the routing key as for AMQP.
- **Endings.** DISCONNECT (MQTT 5: reason 0) ends a connection normally and discards the will.
  Any other end publishes the will, after MQTT 5's will delay unless the client comes back first.
  Unacked QoS 1 deliveries go back to their queues either way.
- **What a persistent session keeps beyond its queues** (``durable.py``): the QoS 2 packet ids
  awaiting PUBREL, its shared subscriptions and its will (from CONNECT on: ``begin`` writes it,
  and the adapter sends CONNACK, ``open``, after the group commit), in a replicated file per
  session; PUBREC and PUBCOMP wait for the group commit that makes the change durable.

The session does no IO: ``Output`` (the network adapter) writes bytes, closes, and runs timers.
"""

from __future__ import annotations

import base64
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from broker import errors
from broker.auth.users import User, UserStore
from broker.model import trace
from broker.model.publish import PublishOutcome
from broker.model.publish_api import Origin
from broker.model.queue import Consumer, Queue
from broker.model.vhost import VHost
from broker.mqtt import packets as P
from broker.mqtt import props as PR
from broker.mqtt.durable import Key, PendingWill, SessionState, SessionStates
from broker.mqtt.mapping import (
    MAX_KEY_BYTES,
    delivered,
    key_fits,
    to_filter,
    to_routing_key,
    to_topic,
)
from broker.mqtt.retained import Retained, topic_matches
from broker.mqtt.wills import arm_will, publish, publish_run

log = logging.getLogger(__name__)

_MAX_PACKET_ID = 65535
NEVER_EXPIRES = 0xFFFFFFFF
TOPIC_ALIAS_MAXIMUM = 64  # inbound topic aliases a client may set up per connection
# QoS 1 and 2 PUBLISHes a client may have unanswered (MQTT 5's receive maximum, told in CONNACK;
# 3.1.1 clients are held to it too): it bounds a session's QoS 2 identifiers awaiting PUBREL,
# and so the state file rewritten at each of them
RECEIVE_MAXIMUM = 1024
# a CONNECT's protocol level as RabbitMQ's management API shows it, and its metrics label
VERSIONS = {3: ("3.1.0", "mqtt310"), 4: ("3.1.1", "mqtt311"), 5: ("5.0", "mqtt50")}


class Output(Protocol):
    """What the network adapter gives the session."""

    writable: bool

    def write(self, data: bytes) -> None: ...

    def close(self) -> None: ...


class AfterSync(Protocol):
    """The group commit's ``after_sync``: ``callback(ok)`` once durable; ``deps`` the stores it
    waits for (None: any)."""

    def __call__(self, callback: Callable[[bool], None], deps: Any = None) -> None: ...


class Cancellable(Protocol):
    def cancel(self) -> None: ...


@dataclass(frozen=True)
class Settings:
    exchange: str  # where MQTT publishes go and subscriptions bind
    prefetch: int  # QoS 1 deliveries in flight per connection
    max_packet: int  # the largest packet a client may send
    max_subscriptions: int = 1_000  # topic filters per session


class Registry:
    """What the sessions of one node share: the connected sessions by (vhost, client id), for
    takeover, the retained messages, the persistent sessions' state and the wills waiting out
    their delay (and the vhosts, users and settings a will is published with)."""

    def __init__(self, retained: Retained,
                 call_later: Callable[[float, Callable[[], None]], Cancellable],
                 states: SessionStates, vhosts: dict[str, VHost], users: UserStore,
                 settings: Settings) -> None:
        self.vhosts = vhosts
        self.users = users
        self.settings = settings
        self.sessions: dict[tuple[str, str], MQTTSession] = {}
        self.retained = retained
        self.call_later = call_later
        self.states = states  # persistent sessions' QoS 2 ids, shared subscriptions, delayed wills
        self.delayed_wills: dict[tuple[str, str], Cancellable] = {}
        # RabbitMQ's per-protocol counters (views.FRONT_END_COUNTERS), by protocol label
        self.counters: dict[str, dict[str, int]] = {label: {} for _, label in VERSIONS.values()}
        # (user, vhost, exchange) -> may write: the sessions' remembered write checks, forgotten
        # whenever the user store changes (bounded: dropped whole when full)
        self.write_checks: dict[tuple[str, str, str], bool] = {}
        self.node_name: Callable[[], str] = lambda: ""  # the node's name (firehose copies); set by the node

    def permissions_changed(self) -> None:
        self.write_checks = {}


OPTIONS_ARG = "x-mqtt-subscription-options"
SUBSCRIPTION_ID_ARG = "x-mqtt-subscription-id"


def binding_args(options: int, sub_id: int) -> dict[str, Any]:
    """What a subscription's binding carries beyond its key: MQTT 5 options and identifier, so a
    resumed session gets them back (none for a plain subscription, as RabbitMQ binds)."""
    if not options & ~3 and not sub_id:
        return {}
    return {OPTIONS_ARG: options, SUBSCRIPTION_ID_ARG: sub_id}


def shared_group(topic_filter: str) -> tuple[str, str] | None:
    """``$share/group/filter`` as (group, filter); None for any other filter."""
    if not topic_filter.startswith("$share/"):
        return None
    _, group, inner = (topic_filter.split("/", 2) + [""])[:3]
    return group, inner


def split_username(username: str, default_vhost: str) -> tuple[str, str]:
    """``vhost:user`` (RabbitMQ's form) or a plain user name on the default vhost."""
    if ":" in username:
        vhost, _, user = username.partition(":")
        return vhost, user
    return default_vhost, username


def runnable(p: P.Packet) -> bool:
    """A PUBLISH that may go in a run (``MQTTSession.publish_run``): QoS 0 or 1, not retained,
    no MQTT 5 properties (so no topic alias either): nothing of it is kept, and a QoS 1 one is
    answered by a PUBACK once the run is durable. A run is of one topic and one QoS."""
    return isinstance(p, P.Publish) and p.qos < 2 and not p.retain and not p.props


_WRITE_CHECKS_MAX = 10_000  # remembered write checks (Registry.write_checks)
CONSUMER_TAG = "mqtt"  # every MQTT consumer's tag, as RabbitMQ's MQTT plugin names them


class MQTTConsumer(Consumer):
    """A session's consumer on one of its queues (``qos``: 0 or 1, the subscription's level;
    ``shared_filter``: the ``$share/...`` filter of a shared subscription's queue)."""

    __slots__ = ("session", "qos", "shared_filter")

    def __init__(self, session: MQTTSession, queue: Queue, qos: int,
                 shared_filter: str | None = None) -> None:
        super().__init__(CONSUMER_TAG, queue, no_ack=qos == 0, exclusive=False)
        self.session = session
        self.qos = qos
        self.shared_filter = shared_filter

    @property
    def prefetch(self) -> int:
        """Deliveries in flight at most (the management API's ``prefetch_count``); QoS 0: none."""
        return self.session.in_flight_max if self.qos else 0

    def ready(self) -> bool:
        return self.capacity() > 0

    def capacity(self) -> int:
        s = self.session
        if s.closed or not s.out.writable:
            return 0
        if not self.qos:
            return 1 << 30
        room = s.in_flight_max - len(s.inflight)
        return room if room > 0 else 0

    def deliver_raw(self, msgid: int, exrk: bytes, props: bytes, body: bytes | memoryview,
                    redelivered: bool) -> None:
        s = self.session
        if s.v5 or type(body) is not bytes or s.vhost is None or s.vhost.meta.tracing:
            super().deliver_raw(msgid, exrk, props, body, redelivered)
            return
        s.deliver_shared(self, msgid, exrk, props, body, redelivered)

    def deliver(self, msgid: int, exchange: bytes, routing_key: bytes, props: bytes, body: bytes,
                redelivered: bool) -> None:
        s = self.session
        vh = s.vhost
        if vh is not None and vh.meta.tracing and s.who is not None:  # firehose: deliver.<queue>
            trace.delivered(vh, s.who, self.queue.name, exchange, routing_key, props, body, redelivered,
                            int(time.time() * 1000))
        s.deliver(self, msgid, routing_key.decode(errors="replace"), props, body, redelivered)

    def deliver_same(self, msgids: range | None, exrk: bytes, props: bytes, bodies: list[bytes]) -> None:
        vh = self.session.vhost
        if msgids is not None or not self.no_ack or (vh is not None and vh.meta.tracing):
            super().deliver_same(msgids, exrk, props, bodies)
            return
        # autoack deliveries of a publish run: decided once for the run (MQTTSession.deliver_same)
        self.session.deliver_same(self, exrk[2 + exrk[0]:].decode(errors="replace"), props, bodies)


class _Shared:
    """What the 3.1.1 PUBLISH packets of one message share, worked out once for all of them.

    A fan-out hands one message to each subscriber's queue in turn, and each queue hands it to
    its consumer with the very same exchange-and-routing-key, properties and body objects
    (``ClassicQueue.publish``): the topic, the QoS the properties carry and the packet's head
    (fixed header, remaining length, topic) are the same for every 3.1.1 subscriber, whose
    packets differ only in their identifiers. ``LAST`` keeps them for the last message seen (by
    identity of its properties and exchange-and-routing-key, and its body's length); MQTT 5
    deliveries depend on the session's filters and go the general way (``_outgoing``)."""

    __slots__ = ("exrk", "props", "size", "topic", "qos", "heads")

    def __init__(self) -> None:
        self.exrk = self.props = b""
        self.size = -1
        self.topic = ""
        self.qos = 0
        self.heads: dict[int, bytes] = {}

    def take(self, exrk: bytes, props: bytes, size: int) -> _Shared:
        """This message's (what was worked out for the last one, when it is the same)."""
        if exrk is not self.exrk or props is not self.props or size != self.size:
            self.exrk, self.props, self.size = exrk, props, size
            self.topic = to_topic(exrk[2 + exrk[0]:].decode(errors="replace"))
            self.qos = delivered(props, False).qos
            self.heads = {}
        return self

    def head(self, qos: int, dup: bool) -> bytes:
        key = qos | dup << 2
        h = self.heads.get(key)
        if h is None:
            h = self.heads[key] = P.publish_head(self.topic, qos, dup, self.size)
        return h


_LAST = _Shared()


class MQTTSession:
    def __init__(self, vhosts: dict[str, VHost], users: UserStore, settings: Settings,
                 after_sync: AfterSync, registry: Registry,
                 out: Output, peer: str) -> None:
        self.vhosts = vhosts
        self.users = users
        self.settings = settings
        self.after_sync = after_sync
        # queues this client's publishes reached since the listener last looked (its hold)
        self.fed: set[Queue] = set()
        self.registry = registry
        self.out = out
        self.peer = peer
        self.client_id = ""
        self.user: User | None = None
        self.vhost: VHost | None = None
        self.v5 = False
        self.durable = False  # the session outlives the connection
        self.session_expiry = 0  # MQTT 5, seconds
        self.will: P.Will | None = None
        self.consumers: dict[str, MQTTConsumer] = {}  # queue name -> consumer
        # packet id -> (queue, msgid); None: a retained message, nothing to settle
        self.inflight: dict[int, tuple[Queue, int] | None] = {}
        self.in_flight_max = settings.prefetch
        self.client_max_packet = 0  # MQTT 5: the largest packet the client takes (0: no limit)
        self.next_id = 1
        self.qos2_received: set[int] = set()  # QoS 2 packet ids stored, awaiting PUBREL
        self.aliases: dict[int, str] = {}  # MQTT 5 inbound topic aliases
        self.filters: dict[str, tuple[int, int]] = {}  # filter -> (options, subscription id or 0)
        self.closed = False
        self.counts: dict[str, int] = {}  # the registry's counters of this protocol level
        self.cap_logged = False  # the subscription limit was logged for this connection
        # retained messages due on a subscription, not yet sent: (topic, payload, QoS, properties)
        self.retained_due: deque[tuple[str, bytes, int, PR.Props]] = deque()
        self.published = False  # it has published (RabbitMQ's publishers gauge)
        self.who: Origin | None = None  # this client as firehose copies name it, once connected
        self.kept: SessionState | None = None  # the state it came back to (``begin``)
        self.assigned = False  # the client id is the server's (MQTT 5: said in CONNACK)
        self.unanswered = 0  # answers waiting in the group commit's queue of callbacks
        self.will_unsaved = False  # ``begin`` could not keep its will

    # ------------------------------------------------------------------ connect
    def start(self, connect: P.Connect, user: User, vhost: VHost) -> None:
        """``begin`` and ``open`` at once (the will, if kept, not yet synced)."""
        self.begin(connect, user, vhost)
        self.open(connect)

    def begin(self, connect: P.Connect, user: User, vhost: VHost) -> bool:
        """A CONNECT the adapter authenticated: take over the client id, take back or drop a
        kept session state, keep a persistent session's will (``durable.py``). True when that
        wrote the state: CONNACK (``open``) waits for the group commit that makes it durable."""
        self.user, self.vhost, self.will = user, vhost, connect.will
        self.who = Origin(self.registry.node_name(), user.name, self.peer, 0)
        self.v5 = connect.level == 5
        self.counts = self.registry.counters[VERSIONS[connect.level][1]]
        cp = connect.props
        if self.v5:
            self.session_expiry = cp.get(PR.SESSION_EXPIRY, 0)
            self.durable = self.session_expiry > 0
            self.in_flight_max = min(self.settings.prefetch, cp.get(PR.RECEIVE_MAXIMUM, 65535))
            self.client_max_packet = cp.get(PR.MAXIMUM_PACKET_SIZE, 0)
        else:
            self.durable = not connect.clean_session
        self.assigned = not connect.client_id
        self.client_id = connect.client_id or "skred-" + base64.urlsafe_b64encode(
            os.urandom(12)).decode().rstrip("=")
        key = (vhost.name, self.client_id)
        old = self.registry.sessions.get(key)
        if old is not None:
            log.info("MQTT client id '%s' in vhost '%s' taken over by %s: closing %s",
                     self.client_id, vhost.name, self.peer, old.peer)
            old.disconnect(P.RC_SESSION_TAKEN_OVER)
        pending_will = self.registry.delayed_wills.pop(key, None)
        if pending_will is not None:  # back within the will delay: the will is not sent
            pending_will.cancel()
        self.registry.sessions[key] = self
        kept = self.registry.states.by_key.get(key)
        if kept is not None and (connect.clean_session or kept.expired(time.time())):
            self._forget_state(key)
            kept = None
        elif kept is not None:  # a persistent session comes back: its QoS 2 ids hold again
            self.qos2_received = set(kept.qos2)
        self.kept = kept
        live = self._live_will()
        if live is None:
            return False
        # the will is part of the session from its CONNECT on: a node that dies while the client
        # is connected sends it after its restart (its shared subscriptions are kept as they were)
        saved = self._save_state(key, SessionState(set(self.qos2_received), dict(kept.shared) if kept else {},
                                                   live))
        self.will_unsaved = not saved  # the disk refused it: the CONNECT is refused (server.py)
        return saved

    def open(self, connect: P.Connect) -> None:
        """After ``begin``: resume or start the session's queues, answer CONNACK, consume."""
        vhost, kept = self.vhost, self.kept
        assert vhost is not None
        key = (vhost.name, self.client_id)
        present = kept is not None
        for qos in (0, 1):
            name = self.queue_name(qos)
            q = vhost.queues.get(name)
            if q is None:
                continue
            if connect.clean_session:  # clean session / clean start: what was left behind goes
                vhost.delete_queue(name, owner=q.exclusive_owner)
                continue
            present = True
            self._restore_filters(q, qos)
            self._consume(q, qos)
        if kept is not None:
            for f, (options, sub_id) in kept.shared.items():
                self._bind(f, options, sub_id)  # its shared subscriptions (permissions checked again)
        state = self._state()
        if state != self.registry.states.by_key.get(key, SessionState()):
            self._save_state(key, state)  # connected: no delayed will, no expiry; its live will
        props: PR.Props = {}
        if self.v5:
            props = {PR.TOPIC_ALIAS_MAXIMUM: TOPIC_ALIAS_MAXIMUM, PR.RECEIVE_MAXIMUM: RECEIVE_MAXIMUM,
                     PR.MAXIMUM_PACKET_SIZE: self.settings.max_packet}
            if self.assigned:
                props[PR.ASSIGNED_CLIENT_ID] = self.client_id
        self.out.write(P.encode_connack(present, P.ACCEPTED, props, self.v5))

    def queue_name(self, qos: int) -> str:
        return f"mqtt-subscription-{self.client_id}qos{qos}"

    # ------------------------------------------------------------------ packets
    def handle(self, p: P.Packet) -> None:
        """One packet after CONNECT. Raises ``P.MalformedPacket`` for a protocol violation."""
        if self.closed:
            return
        if isinstance(p, P.Publish):
            self.publish(p)
        elif isinstance(p, P.PacketId):
            if p.type == P.PUBACK:
                self.puback(p.packet_id)
            elif p.type == P.PUBREL:
                self.pubrel(p.packet_id)
            elif p.type in (P.PUBREC, P.PUBCOMP):
                pass  # the broker sends QoS 2 as QoS 1: a client has no reason to send these
            else:
                raise P.MalformedPacket(f"packet type {p.type} from a client", P.RC_PROTOCOL_ERROR)
        elif isinstance(p, P.Subscribe):
            self.subscribe(p)
        elif isinstance(p, P.Unsubscribe):
            self.unsubscribe(p)
        elif isinstance(p, P.Bare) and p.type == P.PINGREQ:
            self.out.write(P.PINGRESP_BYTES)
        elif isinstance(p, P.Disconnect):
            self.client_disconnect(p)
        else:
            raise P.MalformedPacket("a second CONNECT" if isinstance(p, P.Connect) else f"unexpected {p}",
                                    P.RC_PROTOCOL_ERROR)

    def client_disconnect(self, p: P.Disconnect) -> None:
        expiry = p.props.get(PR.SESSION_EXPIRY)
        if expiry is not None:
            if self.session_expiry == 0 and expiry:
                raise P.MalformedPacket("session expiry set on DISCONNECT after 0 on CONNECT",
                                        P.RC_PROTOCOL_ERROR)
            self.session_expiry = expiry
            if not expiry:
                self.durable = False
        # MQTT 5: "disconnect with will message" (0x04) sends the will as an abnormal end would
        self.end(normal=p.reason != 0x04)
        self.out.close()

    # ------------------------------------------------------------------ publish
    def publish(self, p: P.Publish) -> None:
        assert self.vhost is not None and self.user is not None
        topic = self._topic(p)
        ex = self.settings.exchange
        if not (self._may_write(ex) and self.users.topic_allows(
                self.user, self.vhost.name, ex, "write", to_routing_key(topic))):
            log.warning("MQTT client '%s' (user '%s'): no write permission on exchange '%s' in vhost "
                        "'%s'", self.client_id, self.user.name, ex, self.vhost.name)
            if self.v5 and p.qos:
                self._answer(p, P.RC_NOT_AUTHORIZED, sync=False)
                return
            self.disconnect(P.RC_NOT_AUTHORIZED)
            return
        if p.qos == 2 and p.packet_id in self.qos2_received:
            self.out.write(P.encode_packet_id(P.PUBREC, p.packet_id))  # a resend: stored already
            return
        if p.qos == 2 and len(self.qos2_received) >= RECEIVE_MAXIMUM:
            raise P.MalformedPacket(f"more than {RECEIVE_MAXIMUM} QoS 2 messages awaiting PUBREL",
                                    P.RC_RECEIVE_MAXIMUM_EXCEEDED)
        if p.retain and not self._retain(topic, p):
            if self.v5 and p.qos:
                self._answer(p, P.RC_QUOTA_EXCEEDED, sync=False)
            else:
                self.disconnect(P.RC_QUOTA_EXCEEDED)
            return
        origin = self.client_id if any(o & P.NO_LOCAL for o, _ in self.filters.values()) else None
        out = self._publish(topic, p.payload, p.qos, p.retain, p.props, origin)
        if out is None:
            if self.v5 and p.qos:
                self._answer(p, P.RC_UNSPECIFIED, sync=False)
            else:
                self.disconnect(P.RC_UNSPECIFIED)
            return
        self._count("messages_received")
        self.published = True
        self.fed.update(out.queues)
        if p.qos:
            self._count("messages_received_confirm")
            # the answer waits for the stores the message reached (and the retained file, the
            # session's state)
            deps: set[Any] | None = None if out.held else {q.store for q in out.queues}
            if p.qos == 2:
                self.qos2_received.add(p.packet_id)
                if self.durable and not self._save_state((self.vhost.name, self.client_id)):
                    self.disconnect(P.RC_UNSPECIFIED)  # stored, but a resend could not be known
                    return
                if deps is not None and self.durable:
                    deps.add(self.registry.states.files_of(self.vhost.name))
            if deps is not None and p.retain:
                deps.add(self.registry.retained.files_of(self.vhost.name))
            reason = 0 if not out.unroutable or not self.v5 else P.RC_NO_MATCHING_SUBSCRIBERS
            if p.qos == 1 and not (out.sync or out.held or p.retain):
                # in no durable store: answered as an AMQP confirm is, without the group commit
                self._answer_stored(P.encode_packet_id(P.PUBACK, p.packet_id, reason), 1, deps, False)
                return
            self._answer(p, reason, sync=True, deps=deps)

    def publish_run(self, run: list[P.Publish]) -> bool:
        """PUBLISHes in a row that ``runnable`` takes, to one topic: True when the publish
        operation took them at once (``VHost.publish_run`` decides; one permission check for
        all); False when they must go one by one (``publish``: a refusal, tracing, or a run the
        operation does not take), and nothing of them was published."""
        assert self.vhost is not None and self.user is not None
        topic = self._topic(run[0])
        ex = self.settings.exchange
        vh = self.vhost
        if vh.meta.tracing or not (self._may_write(ex) and self.users.topic_allows(
                self.user, vh.name, ex, "write", to_routing_key(topic))):
            return False
        origin = self.client_id if any(o & P.NO_LOCAL for o, _ in self.filters.values()) else None
        qos = run[0].qos
        out = publish_run(vh, ex, topic, [p.payload for p in run], qos, origin)
        if out is None:
            return False
        self._count("messages_received", len(run))
        self.published = True
        self.fed.update(out.queues)
        if qos:  # each answered as ``publish`` answers it, in order, once the run is durable
            self._count("messages_received_confirm", len(run))
            answers = b"".join(P.encode_packet_id(P.PUBACK, p.packet_id) for p in run)
            self._answer_stored(answers, len(run), {q.store for q in out.queues}, out.sync)
        return True

    def _may_write(self, ex: str) -> bool:
        """The write permission on the exchange, remembered for the user until the user store
        changes (a regex search per PUBLISH was a fifth of QoS 0 fan-in's time, and one per
        connection still 4 % of it with 1,000 publishers). A token's user is checked every
        time: its grants expire."""
        assert self.vhost is not None and self.user is not None
        key = (self.user.name, self.vhost.name, ex)
        checks = self.registry.write_checks
        ok = checks.get(key)
        if ok is not None and self.user.grants is None:
            return ok
        ok = self.users.can_write(self.user, self.vhost.name, ex)
        if self.user.grants is None:
            if len(checks) >= _WRITE_CHECKS_MAX:
                checks.clear()
            checks[key] = ok
        return ok

    def pubrel(self, pid: int) -> None:
        """QoS 2's second half: forget the identifier; PUBCOMP once that is durable (a PUBCOMP
        the client saw must not be followed by a "stored already" for a new PUBLISH)."""
        known = pid in self.qos2_received
        self.qos2_received.discard(pid)
        answer = P.encode_packet_id(P.PUBCOMP, pid, 0 if known or not self.v5 else P.RC_PACKET_ID_NOT_FOUND)
        assert self.vhost is not None
        if not (known and self.durable):
            self.out.write(answer)
            return
        if not self._save_state((self.vhost.name, self.client_id)):
            self.disconnect(P.RC_UNSPECIFIED)
            return
        self.after_sync(lambda ok: None if self.closed or not ok else self.out.write(answer),
                        {self.registry.states.files_of(self.vhost.name)})

    def _state(self) -> SessionState:
        return SessionState(set(self.qos2_received),
                            {f: v for f, v in self.filters.items() if shared_group(f) is not None},
                            None if self.closed else self._live_will())

    def _live_will(self) -> PendingWill | None:
        """A persistent session's will while its client is connected (``durable.py``)."""
        if not self.durable or self.will is None or self.user is None:
            return None
        return PendingWill(self.will, self.user.name, 0.0, self._will_delay())

    def _will_delay(self) -> float:
        return min(self.will.props.get(PR.WILL_DELAY, 0), self.session_expiry) if self.v5 and self.will else 0

    def _save_state(self, key: Key, state: SessionState | None = None) -> bool:
        """Keep the session's state (``durable.py``); False (logged) when the disk refused it."""
        try:
            self.registry.states.save(key, state if state is not None else self._state())
        except OSError as exc:
            log.warning("MQTT client '%s': its session state could not be written: %s", self.client_id, exc)
            return False
        return True

    def _forget_state(self, key: Key) -> None:
        try:
            self.registry.states.forget(key)
        except OSError as exc:
            log.warning("MQTT client '%s': its old session state stays: %s", self.client_id, exc)

    def _topic(self, p: P.Publish) -> str:
        if not key_fits(p.topic):
            raise P.MalformedPacket(f"a topic name of {len(p.topic.encode())} bytes (at most "
                                    f"{MAX_KEY_BYTES})", P.RC_TOPIC_NAME_INVALID)
        alias = p.props.get(PR.TOPIC_ALIAS)
        if alias is None:
            return p.topic
        if alias > TOPIC_ALIAS_MAXIMUM:
            raise P.MalformedPacket(f"topic alias {alias} above the maximum {TOPIC_ALIAS_MAXIMUM}",
                                    P.RC_TOPIC_ALIAS_INVALID)
        if p.topic:
            self.aliases[alias] = p.topic
            return p.topic
        topic = self.aliases.get(alias)
        if topic is None:
            raise P.MalformedPacket(f"topic alias {alias} was never set", P.RC_PROTOCOL_ERROR)
        return topic

    def _answer(self, p: P.Publish, reason: int, sync: bool, deps: set[Any] | None = None) -> None:
        """PUBACK or PUBREC, after the group commit when ``sync`` (the message was stored)."""
        answer = P.encode_packet_id(P.PUBACK if p.qos == 1 else P.PUBREC, p.packet_id, reason)
        if not sync:
            self.unanswered += 1

            def refused(ok: bool) -> None:
                self.unanswered -= 1
                if not self.closed:
                    self.out.write(answer)

            self.after_sync(refused)  # in order
            return
        self._answer_synced(answer, 1, deps)

    def _answer_stored(self, answer: bytes, n: int, deps: set[Any] | None, sync: bool) -> None:
        """The PUBACKs of ``n`` published messages: after the group commit when ``sync`` (a
        durable store took them) or an earlier answer still waits for one (answers go in the
        order of their PUBLISHes, MQTT 3.1.1 section 4.6); at once otherwise (an AMQP publisher
        confirm of a message in no durable queue does not wait either)."""
        if sync or self.unanswered:
            self._answer_synced(answer, n, deps)
            return
        self._count("messages_confirmed", n)
        self.out.write(answer)

    def _answer_synced(self, answer: bytes, n: int, deps: set[Any] | None) -> None:
        """``answer`` (the PUBACKs or PUBREC of ``n`` stored messages) once they are durable;
        the connection closed instead when they could not be made so."""
        self.unanswered += 1

        def synced(ok: bool) -> None:
            self.unanswered -= 1
            if self.closed:
                return
            if ok:
                self._count("messages_confirmed", n)
                self.out.write(answer)
            else:  # not durable: no ack; the client sends it again on its next connection
                log.warning("MQTT client '%s': a message could not be made durable: closing",
                            self.client_id)
                self.disconnect(P.RC_UNSPECIFIED)

        self.after_sync(synced, deps)

    def _retain(self, topic: str, p: P.Publish) -> bool:
        assert self.vhost is not None
        try:
            if self.registry.retained.set(self.vhost.name, topic, p.qos, p.payload):
                return True
            log.warning("MQTT client '%s': retained message for '%s' refused: the node holds the "
                        "most retained messages it may ([mqtt] max_retained)", self.client_id, topic)
        except OSError as exc:
            log.warning("MQTT client '%s': retained message for '%s' not stored: %s", self.client_id,
                        topic, exc)
        return False

    def _publish(self, topic: str, payload: bytes, qos: int, retain: bool, props: PR.Props,
                 origin: str | None = None) -> PublishOutcome | None:
        assert self.vhost is not None
        return publish(self.vhost, self.settings.exchange, self.client_id, topic, payload, qos, retain, props,
                       origin, self.who)

    # ------------------------------------------------------------------ subscribe
    def subscribe(self, p: P.Subscribe) -> None:
        assert self.vhost is not None
        sub_id = p.props.get(PR.SUBSCRIPTION_ID, 0)
        results = [self._bind(f, options, sub_id) for f, options in p.filters]
        if self.durable and any(shared_group(f) is not None for f, _ in p.filters):
            self._save_state((self.vhost.name, self.client_id))  # its shared subscriptions
        self.out.write(P.encode_suback(p.packet_id, [code for code, _ in results], self.v5))
        for (f, options), (granted, existed) in zip(p.filters, results, strict=True):
            if granted >= P.SUBACK_FAILURE or shared_group(f) is not None:
                continue  # no retained messages for a shared subscription (section 4.8.2)
            handling = P.retain_handling(options)
            if handling == 2 or (handling == 1 and existed):
                continue
            props: PR.Props = {PR.SUBSCRIPTION_ID: sub_id} if sub_id and self.v5 else {}
            for topic, qos, payload in self.registry.retained.matching(self.vhost.name, f):
                self.retained_due.append((topic, payload, min(qos, granted), props))
        self._send_retained()

    def _send_retained(self) -> None:
        """Retained messages due on a subscription go out as queued deliveries do: while the
        socket takes them and, at QoS 1, within the in-flight limit (the client's receive
        maximum); the rest wait here (the payloads are the retained store's own)."""
        due = self.retained_due
        while due and self.out.writable and not self.closed:
            topic, payload, qos, props = due[0]
            if qos and len(self.inflight) >= self.in_flight_max:
                return
            due.popleft()
            self._send(topic, payload, qos, True, props, None)

    def _bind(self, topic_filter: str, options: int, sub_id: int) -> tuple[int, bool]:
        """One filter of a SUBSCRIBE: (the granted QoS or a failure code, whether it existed)."""
        assert self.vhost is not None and self.user is not None
        vh, user, ex = self.vhost, self.user, self.settings.exchange
        existed = topic_filter in self.filters
        fail = P.RC_UNSPECIFIED if self.v5 else P.SUBACK_FAILURE
        if not existed and len(self.filters) >= self.settings.max_subscriptions:
            if not self.cap_logged:  # once per connection: a flood of them must not flood the log
                self.cap_logged = True
                log.warning("MQTT client '%s': subscriptions refused: over the limit of %d per session "
                            "([mqtt] max_subscriptions)", self.client_id, self.settings.max_subscriptions)
            return (P.RC_QUOTA_EXCEEDED if self.v5 else fail), existed
        if not key_fits(topic_filter):
            log.warning("MQTT client '%s': a topic filter of %d bytes refused (at most %d)", self.client_id,
                        len(topic_filter.encode()), MAX_KEY_BYTES)
            return (P.RC_TOPIC_FILTER_INVALID if self.v5 else fail), existed
        granted = min(options & 3, 1)
        shared = shared_group(topic_filter)
        if shared is not None:
            if options & P.NO_LOCAL:
                raise P.MalformedPacket("no-local on a shared subscription", P.RC_PROTOCOL_ERROR)
            group, inner = shared
            name = f"mqtt-shared-{group}-{inner}"
            if not group or "+" in group or "#" in group or len(name.encode()) > 255:
                return (P.RC_TOPIC_FILTER_INVALID if self.v5 else fail), existed
        else:
            inner, name = topic_filter, self.queue_name(granted)
        if not (self.users.can_configure(user, vh.name, name) and self.users.can_write(user, vh.name, name)
                and self.users.can_read(user, vh.name, name) and self.users.can_read(user, vh.name, ex)
                and self.users.topic_allows(user, vh.name, ex, "read", to_routing_key(inner))):
            log.warning("MQTT client '%s' (user '%s'): subscription to '%s' refused: no permission",
                        self.client_id, user.name, topic_filter)
            return (P.RC_NOT_AUTHORIZED if self.v5 else P.SUBACK_FAILURE), existed
        key = to_routing_key(inner)
        try:
            q = vh.queues.get(name)
            if q is None:
                args: dict[str, Any] = {}
                if self.durable and self.v5 and self.session_expiry != NEVER_EXPIRES:
                    args["x-expires"] = self.session_expiry * 1000
                q, _ = vh.declare_queue(name, durable=self.durable,
                                        exclusive=not self.durable and shared is None,
                                        auto_delete=shared is not None, arguments=args, owner=self)
            if shared is None:
                self._unbind(topic_filter)  # a resubscription replaces the binding (QoS, options)
                vh.bind_queue(name, ex, key, binding_args(options, sub_id), owner=self)
            else:  # the group's members share one binding and one queue; options are per member
                vh.bind_queue(name, ex, key, {}, owner=self)
        except errors.SkredError as exc:
            log.warning("MQTT client '%s': subscription to '%s' failed: %s", self.client_id,
                        topic_filter, exc)
            return fail, existed
        self.filters[topic_filter] = (options, sub_id)
        if name not in self.consumers:
            self._consume(q, granted, topic_filter if shared is not None else None)
        return granted, existed

    def _unbind(self, topic_filter: str) -> bool:
        """Remove a (non-shared) subscription's binding; whether there was one."""
        old = self.filters.get(topic_filter)
        if old is None:
            return False
        assert self.vhost is not None
        key, args = to_routing_key(topic_filter), binding_args(*old)
        for qos in (0, 1):
            q = self.vhost.queues.get(self.queue_name(qos))
            if q is not None:
                try:
                    self.vhost.unbind_queue(q.name, self.settings.exchange, key, args, owner=self)
                except errors.SkredError:
                    pass  # bound to the other queue
        return True

    def unsubscribe(self, p: P.Unsubscribe) -> None:
        codes = []
        for f in p.filters:
            if shared_group(f) is not None:
                found = f in self.filters
                for name, c in list(self.consumers.items()):
                    if c.shared_filter == f:  # leave the group: its queue goes with its last member
                        del self.consumers[name]
                        c.queue.remove_consumer(c)
            else:
                found = self._unbind(f)
            self.filters.pop(f, None)
            codes.append(0 if found else 0x11)  # 0x11: no subscription existed
        if self.durable and any(shared_group(f) is not None for f in p.filters):
            assert self.vhost is not None
            self._save_state((self.vhost.name, self.client_id))
        self.out.write(P.encode_unsuback(p.packet_id, codes, self.v5))

    def _consume(self, q: Queue, qos: int, shared_filter: str | None = None) -> None:
        c = MQTTConsumer(self, q, qos, shared_filter)
        self.consumers[q.name] = c
        q.add_consumer(c)

    def _restore_filters(self, q: Queue, qos: int) -> None:
        """A resumed session's subscriptions, from its queue's bindings (options and identifiers
        travel in the binding arguments)."""
        assert self.vhost is not None
        ex = self.vhost.exchanges.get(self.settings.exchange)
        if ex is None:
            return
        for key, args in ex.bindings_of(q):
            options = args.get(OPTIONS_ARG, qos)
            sub_id = args.get(SUBSCRIPTION_ID_ARG, 0)
            self.filters[to_filter(key)] = (options if isinstance(options, int) else qos,
                                           sub_id if isinstance(sub_id, int) else 0)

    # ------------------------------------------------------------------ deliver
    def deliver(self, c: MQTTConsumer, msgid: int, routing_key: str, props: bytes, body: bytes,
                redelivered: bool) -> None:
        how = self._outgoing(c, routing_key, props)
        if how is None:
            if not c.no_ack:
                c.queue.ack(msgid)  # the client's own message on a no-local subscription
            return
        topic, qos, retain, out_props = how
        self._send(topic, body, qos, retain, out_props, (c.queue, msgid) if not c.no_ack else None,
                   redelivered)

    def deliver_shared(self, c: MQTTConsumer, msgid: int, exrk: bytes, props: bytes, body: bytes,
                       redelivered: bool) -> None:
        """``deliver`` to a 3.1.1 session (not traced, the body in hand): the packet is the
        message's shared head (``_Shared``), its identifier and the body."""
        m = _LAST.take(exrk, props, len(body))
        qos = c.qos if c.qos < m.qos else m.qos
        counts = self.counts
        counts["messages_delivered"] = counts.get("messages_delivered", 0) + 1
        if qos:
            pid = self._packet_id()
            self.inflight[pid] = (c.queue, msgid)
            key = "messages_delivered_consume_manual_ack"
            counts[key] = counts.get(key, 0) + 1
            self.out.write(m.head(1, redelivered) + P.U16_PACK(pid) + body)
            return
        if not c.no_ack:  # a QoS 0 message in the QoS 1 queue: settled once written
            c.queue.ack(msgid)
        key = "messages_delivered_consume_auto_ack"
        counts[key] = counts.get(key, 0) + 1
        self.out.write(m.head(0, False) + body)

    def deliver_same(self, c: MQTTConsumer, routing_key: str, props: bytes, bodies: list[bytes]) -> None:
        """``deliver`` for a run of autoack (QoS 0 subscription) deliveries that differ only in
        their bodies, all of one length: what ``deliver`` decides per message is decided once,
        and the packets share one encoded header."""
        how = self._outgoing(c, routing_key, props)
        if how is None or not bodies:
            return
        topic, qos, retain, out_props = how
        if qos:  # (a QoS 0 subscription: never)
            for body in bodies:
                self._send(topic, body, qos, retain, out_props, None)
            return
        first = P.encode_publish(topic, bodies[0], 0, retain, False, 0, out_props, self.v5)
        if self.client_max_packet and len(first) > self.client_max_packet:
            for body in bodies:  # each dropped, and logged, as ``_send`` does
                self._send(topic, body, qos, retain, out_props, None)
            return
        head = first[:len(first) - len(bodies[0])]
        out = self.out
        for body in bodies:
            out.write(head + body)
        k = len(bodies)
        self._count("messages_delivered", k)
        self._count("messages_delivered_consume_auto_ack", k)

    def _outgoing(self, c: MQTTConsumer, routing_key: str, props: bytes
                  ) -> tuple[str, int, bool, PR.Props] | None:
        """How a delivery of ``c`` goes out: topic, QoS, retain flag and MQTT 5 properties; None
        when it does not (MQTT 5 no-local: the client's own message)."""
        m = delivered(props, self.v5)
        topic = to_topic(routing_key)
        retain = False
        out_props = m.props
        if self.v5:
            if c.shared_filter is not None:
                matched = [self.filters.get(c.shared_filter, (c.qos, 0))]
            else:  # this queue's filters (one copy per queue: QoS 0 and 1 subscriptions overlap)
                matched = [(o, i) for f, (o, i) in self.filters.items() if min(o & 3, 1) == c.qos
                           and not f.startswith("$share/") and topic_matches(f, topic)]
                if matched and m.origin == self.client_id and all(o & P.NO_LOCAL for o, _ in matched):
                    return None
            retain = m.retain and any(o & P.RETAIN_AS_PUBLISHED for o, _ in matched)
            ids = sorted({i for _, i in matched if i})
            if ids:
                out_props = {**out_props, PR.SUBSCRIPTION_ID: ids}
        return topic, min(c.qos, m.qos), retain, out_props

    def _send(self, topic: str, body: bytes, qos: int, retain: bool, props: PR.Props,
              settle: tuple[Queue, int] | None, dup: bool = False) -> None:
        pid = self._packet_id() if qos else 0
        data = P.encode_publish(topic, body, qos, retain, dup and qos > 0, pid, props, self.v5)
        if self.client_max_packet and len(data) > self.client_max_packet:
            log.info("MQTT client '%s': a message of %d bytes for '%s' dropped: over the client's "
                     "maximum packet size %d", self.client_id, len(data), topic, self.client_max_packet)
            if settle is not None:
                settle[0].ack(settle[1])
            return
        if qos:
            self.inflight[pid] = settle
        elif settle is not None:  # a QoS 0 message in the QoS 1 queue: settled once written
            settle[0].ack(settle[1])
        self._count("messages_delivered")
        self._count("messages_delivered_consume_manual_ack" if qos else "messages_delivered_consume_auto_ack")
        self.out.write(data)

    def _packet_id(self) -> int:
        pid = self.next_id
        while pid in self.inflight:
            pid = pid % _MAX_PACKET_ID + 1
        self.next_id = pid % _MAX_PACKET_ID + 1
        return pid

    def puback(self, pid: int) -> None:
        if pid not in self.inflight:
            return  # an unknown identifier (a duplicate PUBACK): nothing to settle
        got = self.inflight.pop(pid)
        self._count("messages_acknowledged")
        if got is not None and not got[0].deleted:
            got[0].ack(got[1])
        self.refill()

    def pubacks(self, pids: list[int]) -> None:
        """``puback`` for each of several identifiers (one read's PUBACKs), with one refill."""
        inflight = self.inflight
        acked = 0
        for pid in pids:
            if pid not in inflight:
                continue  # an unknown identifier (a duplicate PUBACK): nothing to settle
            got = inflight.pop(pid)
            acked += 1
            if got is not None and not got[0].deleted:
                got[0].ack(got[1])
        if acked:
            self._count("messages_acknowledged", acked)
            self.refill()

    def refill(self) -> None:
        """In-flight room came back (a PUBACK): due retained messages go out, and the queues
        with messages ready get a delivery pass (one with none has nothing to hand over: a
        message published to it reaches a consumer with room at once)."""
        if self.retained_due:
            self._send_retained()
        for c in self.consumers.values():
            q = c.queue
            if q.message_count:
                q.schedule_delivery()

    def _count(self, name: str, n: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + n

    def resume(self) -> None:
        """Capacity came back (an ack, a drained socket): let the queues deliver."""
        self._send_retained()
        for c in self.consumers.values():
            c.queue.schedule_delivery()

    # ------------------------------------------------------------------ end
    def disconnect(self, reason: int) -> None:
        """The server ends the connection: MQTT 5 says why first; the will goes out."""
        if self.closed:
            return
        if self.v5:
            self.out.write(P.encode_disconnect(reason))
        self.end(normal=False)
        self.out.close()

    def end(self, normal: bool) -> None:
        """The connection ends: requeue what is in flight, publish the will unless ``normal``,
        let a session that ends with its connection go. Idempotent."""
        if self.closed:
            return
        self.closed = True
        vh = self.vhost
        if vh is None:
            return
        key = (vh.name, self.client_id)
        if self.registry.sessions.get(key) is self:
            del self.registry.sessions[key]
        for c in self.consumers.values():
            c.queue.remove_consumer(c)
        for got in self.inflight.values():
            if got is not None and not got[0].deleted:
                got[0].reject(got[1], requeue=True)
        self.inflight.clear()
        pending = self._will(key) if not normal and self.will is not None else None
        if self.durable:  # what it keeps while its client is away: its will if delayed, its expiry
            state = self._state()
            # a durable timer (a restart or a new leader sends it when due), or no will at all
            state.will = pending if pending is not None and pending.due > time.time() else None
            if self.v5 and self.session_expiry != NEVER_EXPIRES:
                state.expires_at = time.time() + self.session_expiry
            if not state.empty() or key in self.registry.states.by_key:
                self._save_state(key, state)
        else:
            if key in self.registry.states.by_key:
                self._forget_state(key)
            for qos in (0, 1):
                q = vh.queues.get(self.queue_name(qos))
                if q is not None:
                    try:
                        vh.delete_queue(q.name, owner=q.exclusive_owner)
                    except errors.SkredError as exc:
                        log.warning("MQTT client '%s': its session's queue '%s' stays: %s",
                                    self.client_id, q.name, exc)

    def _will(self, key: Key) -> PendingWill:
        """Publish the will now or after its delay (``wills.arm_will``); the will, due when."""
        w, user = self.will, self.user
        assert w is not None and user is not None
        pending = PendingWill(w, user.name, time.time() + self._will_delay())
        arm_will(self.registry, key, pending)
        return pending

