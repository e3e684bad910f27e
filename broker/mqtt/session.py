"""One MQTT connection turned into the model's operations: publish, queues, consume, settle.

Theory of operation
-------------------
MQTT is mapped onto the core the way RabbitMQ maps it, so AMQP and MQTT clients meet:

- **Publish.** A PUBLISH goes through the one publish operation (``VHost.publish``) to the
  MQTT exchange (``[mqtt] exchange``, default ``amq.topic``) with the topic as routing key, ``/``
  and ``.`` swapped (``a/b.c`` -> ``a.b/c``), so AMQP topic bindings ``a.*`` see MQTT topics
  ``a/x``. QoS 1 and 2 messages are persistent (delivery mode 2); the QoS travels in the header
  ``x-mqtt-publish-qos``. A QoS 1 PUBLISH is answered (PUBACK) only once the message is as
  durable as an AMQP publisher confirm makes it (the group commit, the in-sync followers in a
  cluster): the acks wait in the syncer's queue of callbacks, which keeps them in order. A QoS 2
  PUBLISH is stored once and answered with PUBREC; its packet identifier is remembered until
  PUBREL, so a resent PUBLISH with the same identifier is not stored twice.
- **Subscriptions are queues.** A session's subscriptions are bindings of its queues to the MQTT
  exchange: ``mqtt-subscription-<client id>qos0`` for QoS 0 filters, ``...qos1`` for QoS 1 and 2
  (QoS 2 is granted as 1, as RabbitMQ does), named as RabbitMQ names them. A clean session's
  queues are exclusive to the connection and go with it; a persistent session's are durable, so
  its subscriptions and its QoS 1 messages survive the client's absence, a restart, kill -9 and
  a failover, and CONNACK says ``session present`` when they exist.
- **Delivery.** The session consumes from its queues with ``MQTTConsumer``: QoS 0 deliveries are
  settled when written; QoS 1 deliveries take a packet identifier and stay unacked in the queue
  until PUBACK, at most ``[mqtt] prefetch`` at a time (the consumer's capacity), and come back to
  the queue when the connection ends. The delivered QoS is the lower of the subscription's and
  the message's (the header, or delivery mode 2 for an AMQP message).
- **Authentication and permissions** are AMQP's: the CONNECT's user name and password log in
  through the same users and login throttle (the adapter does that before ``start``); a user name
  ``vhost:user`` picks the vhost. Publishing needs write on the exchange; a subscription needs
  configure on its queue, write on the queue and read on the exchange (to bind), read on the queue
  (to consume), checked per filter: a refused filter gets SUBACK's failure code, the others work.
- **Retained messages** (``retained.py``): a PUBLISH with the retain flag is stored as its
  topic's retained message before it is published (an empty payload clears it), durable by the
  same group commit its PUBACK waits for; a subscription is sent the retained messages its filter
  matches, wildcards included, right after SUBACK, with the retain flag set.
- **Endings.** DISCONNECT ends a connection normally: the will is discarded. Any other end (a
  lost socket, keepalive expiry, a protocol violation, a takeover by the same client id) publishes
  the will. Unacked QoS 1 deliveries go back to their queues either way.

The session does no IO: ``Output`` (the network adapter) writes bytes and closes.
"""

from __future__ import annotations

import base64
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from pamqp import commands

from broker import errors, properties
from broker.auth.users import User, UserStore
from broker.model.publish import PublishRequest
from broker.model.queue import Consumer, Queue
from broker.model.vhost import VHost
from broker.mqtt import packets as P
from broker.mqtt.retained import Retained

log = logging.getLogger(__name__)

QOS_HEADER = "x-mqtt-publish-qos"
_MAX_PACKET_ID = 65535


class Output(Protocol):
    """What the network adapter gives the session."""

    writable: bool

    def write(self, data: bytes) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Settings:
    exchange: str  # where MQTT publishes go and subscriptions bind
    prefetch: int  # QoS 1 deliveries in flight per connection


class Registry:
    """What the sessions of one node share: the connected sessions by (vhost, client id), for
    takeover, and the retained messages."""

    def __init__(self, retained: Retained) -> None:
        self.sessions: dict[tuple[str, str], MQTTSession] = {}
        self.retained = retained


def to_routing_key(topic: str) -> str:
    """MQTT topic (or filter) to AMQP routing key (or binding key): ``/`` <-> ``.``, ``+`` -> ``*``."""
    return topic.translate(_TO_AMQP)


def to_topic(routing_key: str) -> str:
    return routing_key.translate(_TO_MQTT)


_TO_AMQP = str.maketrans({"/": ".", ".": "/", "+": "*"})
_TO_MQTT = str.maketrans({".": "/", "/": "."})


def split_username(username: str, default_vhost: str) -> tuple[str, str]:
    """``vhost:user`` (RabbitMQ's form) or a plain user name on the default vhost."""
    if ":" in username:
        vhost, _, user = username.partition(":")
        return vhost, user
    return default_vhost, username


def _props(qos: int) -> bytes:
    return properties.encode(commands.Basic.Properties(delivery_mode=2 if qos else 1,
                                                       headers={QOS_HEADER: qos}))


def _message_qos(props: bytes) -> int:
    q = properties.headers(props).get(QOS_HEADER) if props else None
    if isinstance(q, int) and 0 <= q <= 2:
        return q
    return 1 if properties.delivery_mode(props) == 2 else 0


class MQTTConsumer(Consumer):
    """A session's consumer on one of its queues (``qos``: 0 or 1, the queue's level)."""

    __slots__ = ("session", "qos")

    def __init__(self, session: MQTTSession, queue: Queue, qos: int) -> None:
        super().__init__(f"mqtt.{session.client_id}.qos{qos}", queue, no_ack=qos == 0, exclusive=False)
        self.session = session
        self.qos = qos

    def ready(self) -> bool:
        return self.capacity() > 0

    def capacity(self) -> int:
        s = self.session
        if not s.out.writable or s.closed:
            return 0
        if self.qos == 0:
            return 1 << 30
        return max(0, s.settings.prefetch - len(s.inflight))

    def deliver(self, msgid: int, exchange: bytes, routing_key: bytes, props: bytes, body: bytes,
                redelivered: bool) -> None:
        self.session.deliver(self, msgid, routing_key.decode(errors="replace"), props, body, redelivered)


class MQTTSession:
    def __init__(self, vhosts: dict[str, VHost], users: UserStore, settings: Settings,
                 after_sync: Callable[[Callable[[bool], None]], None], registry: Registry,
                 out: Output, peer: str) -> None:
        self.vhosts = vhosts
        self.users = users
        self.settings = settings
        self.after_sync = after_sync
        self.registry = registry
        self.out = out
        self.peer = peer
        self.client_id = ""
        self.user: User | None = None
        self.vhost: VHost | None = None
        self.clean = True
        self.will: P.Will | None = None
        self.consumers: dict[int, MQTTConsumer] = {}  # queue QoS level -> consumer
        # packet id -> (queue, msgid); None: a retained message, nothing to settle
        self.inflight: dict[int, tuple[Queue, int] | None] = {}
        self.next_id = 1
        self.qos2_received: set[int] = set()  # QoS 2 packet ids stored, awaiting PUBREL
        self.acks_waiting = 0  # PUBACK/PUBREC answers queued behind the group commit
        self.closed = False
        self.published = 0
        self.delivered = 0

    # ------------------------------------------------------------------ connect
    def start(self, connect: P.Connect, user: User, vhost: VHost) -> None:
        """A CONNECT the adapter authenticated: take over the client id, resume or start the
        session, answer CONNACK, consume."""
        self.user, self.vhost, self.clean, self.will = user, vhost, connect.clean_session, connect.will
        self.client_id = connect.client_id or "skred-" + base64.urlsafe_b64encode(
            os.urandom(12)).decode().rstrip("=")
        key = (vhost.name, self.client_id)
        old = self.registry.sessions.get(key)
        if old is not None:
            log.info("MQTT client id '%s' in vhost '%s' taken over by %s: closing %s",
                     self.client_id, vhost.name, self.peer, old.peer)
            old.end(normal=False)
            old.out.close()
        self.registry.sessions[key] = self
        present = False
        for qos in (0, 1):
            name = self.queue_name(qos)
            q = vhost.queues.get(name)
            if q is None:
                continue
            if self.clean:  # a clean session starts with nothing: a persistent one left behind goes
                if q.exclusive_owner is None:
                    vhost.delete_queue(name, owner=None)
                continue
            present = True
            self._consume(q, qos)
        self.out.write(P.encode_connack(present, P.ACCEPTED))

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
                self.qos2_received.discard(p.packet_id)
                self.out.write(P.encode_packet_id(P.PUBCOMP, p.packet_id))
            elif p.type in (P.PUBREC, P.PUBCOMP):
                pass  # the broker sends QoS 2 as QoS 1: a client has no reason to send these
            else:
                raise P.MalformedPacket(f"packet type {p.type} from a client")
        elif isinstance(p, P.Subscribe):
            self.subscribe(p)
        elif isinstance(p, P.Unsubscribe):
            self.unsubscribe(p)
        elif isinstance(p, P.Bare) and p.type == P.PINGREQ:
            self.out.write(P.PINGRESP_BYTES)
        elif isinstance(p, P.Bare) and p.type == P.DISCONNECT:
            self.end(normal=True)
            self.out.close()
        else:
            raise P.MalformedPacket("a second CONNECT" if isinstance(p, P.Connect) else f"unexpected {p}")

    # ------------------------------------------------------------------ publish
    def publish(self, p: P.Publish) -> None:
        assert self.vhost is not None and self.user is not None
        ex = self.settings.exchange
        if not self.users.can_write(self.user, self.vhost.name, ex):
            log.warning("MQTT client '%s' (user '%s'): no write permission on exchange '%s' in vhost "
                        "'%s': closing", self.client_id, self.user.name, ex, self.vhost.name)
            self.end(normal=False)
            self.out.close()
            return
        if p.qos == 2 and p.packet_id in self.qos2_received:
            self.out.write(P.encode_packet_id(P.PUBREC, p.packet_id))  # a resend: stored already
            return
        if p.retain and not self._retain(p):
            self.end(normal=False)
            self.out.close()
            return
        if not self._publish(p.topic, p.payload, p.qos):
            self.end(normal=False)
            self.out.close()
            return
        if p.qos == 0:
            return
        if p.qos == 2:
            self.qos2_received.add(p.packet_id)
        answer = P.encode_packet_id(P.PUBACK if p.qos == 1 else P.PUBREC, p.packet_id)
        self.acks_waiting += 1

        def synced(ok: bool) -> None:
            self.acks_waiting -= 1
            if self.closed:
                return
            if ok:
                self.out.write(answer)
            else:  # not durable: no ack; the client sends it again on its next connection
                log.warning("MQTT client '%s': a message could not be made durable: closing",
                            self.client_id)
                self.end(normal=False)
                self.out.close()

        self.after_sync(synced)

    def _retain(self, p: P.Publish) -> bool:
        assert self.vhost is not None
        try:
            if self.registry.retained.set(self.vhost.name, p.topic, p.qos, p.payload):
                return True
            log.warning("MQTT client '%s': retained message for '%s' refused: the node holds the "
                        "most retained messages it may ([mqtt] max_retained)", self.client_id, p.topic)
        except OSError as exc:
            log.warning("MQTT client '%s': retained message for '%s' not stored: %s", self.client_id,
                        p.topic, exc)
        return False

    def _publish(self, topic: str, payload: bytes, qos: int) -> bool:
        """Through the one publish operation; False when it did not happen (the caller closes)."""
        assert self.vhost is not None
        req = PublishRequest(self.settings.exchange, to_routing_key(topic), _props(qos), payload,
                             int(time.time() * 1000), persistent=qos > 0)
        try:
            out = self.vhost.publish(req)
        except errors.SkredError as exc:
            log.warning("MQTT client '%s': publish to '%s' refused: %s", self.client_id, topic, exc)
            return False
        self.published += 1
        return not out.rejected

    # ------------------------------------------------------------------ subscribe
    def subscribe(self, p: P.Subscribe) -> None:
        assert self.vhost is not None
        codes = [self._subscribe_one(f, qos) for f, qos in p.filters]
        self.out.write(P.encode_suback(p.packet_id, codes))
        for (f, _), granted in zip(p.filters, codes, strict=True):
            if granted == P.SUBACK_FAILURE:
                continue
            for topic, qos, payload in self.registry.retained.matching(self.vhost.name, f):
                qos = min(qos, granted)
                pid = self._packet_id() if qos else 0
                if qos:
                    self.inflight[pid] = None
                self.out.write(P.encode_publish(topic, payload, qos, True, False, pid))

    def _subscribe_one(self, topic_filter: str, qos: int) -> int:
        assert self.vhost is not None and self.user is not None
        vh, user, ex = self.vhost, self.user, self.settings.exchange
        granted = min(qos, 1)
        name = self.queue_name(granted)
        if not (self.users.can_configure(user, vh.name, name) and self.users.can_write(user, vh.name, name)
                and self.users.can_read(user, vh.name, name) and self.users.can_read(user, vh.name, ex)):
            log.warning("MQTT client '%s' (user '%s'): subscription to '%s' refused: no permission",
                        self.client_id, user.name, topic_filter)
            return P.SUBACK_FAILURE
        key = to_routing_key(topic_filter)
        try:
            q = vh.queues.get(name)
            if q is None:
                q, _ = vh.declare_queue(name, durable=not self.clean, exclusive=self.clean,
                                        auto_delete=False, owner=self)
            vh.bind_queue(name, ex, key, {}, owner=self)
            other = vh.queues.get(self.queue_name(1 - granted))
            if other is not None:  # a resubscription at the other QoS replaces the binding
                vh.unbind_queue(other.name, ex, key, {}, owner=self)
        except errors.SkredError as exc:
            log.warning("MQTT client '%s': subscription to '%s' failed: %s", self.client_id,
                        topic_filter, exc)
            return P.SUBACK_FAILURE
        if granted not in self.consumers:
            self._consume(q, granted)
        return granted

    def unsubscribe(self, p: P.Unsubscribe) -> None:
        assert self.vhost is not None
        for f in p.filters:
            key = to_routing_key(f)
            for qos in (0, 1):
                q = self.vhost.queues.get(self.queue_name(qos))
                if q is not None:
                    try:
                        self.vhost.unbind_queue(q.name, self.settings.exchange, key, {}, owner=self)
                    except errors.SkredError as exc:
                        log.warning("MQTT client '%s': unsubscribe '%s': %s", self.client_id, f, exc)
        self.out.write(P.encode_packet_id(P.UNSUBACK, p.packet_id))

    def _consume(self, q: Queue, qos: int) -> None:
        c = MQTTConsumer(self, q, qos)
        self.consumers[qos] = c
        q.add_consumer(c)

    # ------------------------------------------------------------------ deliver
    def deliver(self, c: MQTTConsumer, msgid: int, routing_key: str, props: bytes, body: bytes,
                redelivered: bool) -> None:
        qos = min(c.qos, _message_qos(props))
        topic = to_topic(routing_key)
        self.delivered += 1
        if qos == 0:
            self.out.write(P.encode_publish(topic, body, 0, False, False, 0))
            if not c.no_ack:  # a QoS 0 message in the QoS 1 queue: settled once written
                c.queue.ack(msgid)
            return
        pid = self._packet_id()
        self.inflight[pid] = (c.queue, msgid)
        self.out.write(P.encode_publish(topic, body, 1, False, redelivered, pid))

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
        if got is None:
            return  # a retained message: nothing in a queue
        q, msgid = got
        if not q.deleted:
            q.ack(msgid)
        self.resume()

    def resume(self) -> None:
        """Capacity came back (an ack, a drained socket): let the queues deliver."""
        for c in self.consumers.values():
            c.queue.schedule_delivery()

    # ------------------------------------------------------------------ end
    def end(self, normal: bool) -> None:
        """The connection ends: requeue what is in flight, publish the will unless ``normal``,
        let a clean session's queues go. Idempotent."""
        if self.closed:
            return
        self.closed = True
        vh = self.vhost
        if vh is None:
            return
        if self.registry.sessions.get((vh.name, self.client_id)) is self:
            del self.registry.sessions[(vh.name, self.client_id)]
        for c in self.consumers.values():
            c.queue.remove_consumer(c)
        for got in self.inflight.values():
            if got is not None and not got[0].deleted:
                got[0].reject(got[1], requeue=True)
        self.inflight.clear()
        if not normal and self.will is not None:
            w = self.will
            if self.user is not None and self.users.can_write(self.user, vh.name, self.settings.exchange):
                self._publish(w.topic, w.message, w.qos)
        if self.clean:
            try:
                vh.delete_exclusive(self)
            except errors.SkredError as exc:
                log.warning("MQTT client '%s': its clean session's queues stay: %s", self.client_id, exc)

    def stats(self) -> dict[str, Any]:
        return {"client_id": self.client_id, "published": self.published, "delivered": self.delivered,
                "inflight": len(self.inflight)}
