"""Wills, and the publish operation sessions and wills share.

Theory of operation
-------------------
A will is published when its connection ends in any way but DISCONNECT (``session.py``),
after MQTT 5's will delay unless its client comes back first. ``arm_will`` runs the delay on the
event loop's timer. A persistent session's will is kept in the session's durable state from
its CONNECT on (``durable.py``), and once its connection ended with the wall-clock time it is
due, so a node that restarts, or the new leader after a failover, arms it again at start
(``server.py``: a will whose client was connected when the node went is due its delay after the
start) and publishes it when due, or at once when overdue. A will is published as its user,
through the one publish operation, only if that user may still write to its topic (write on the
exchange, the topic permission); once sent it is forgotten from the session's state.
"""

from __future__ import annotations

import logging
import time
from functools import lru_cache
from typing import TYPE_CHECKING

from broker import errors
from broker.model.publish import PublishOutcome, PublishRequest
from broker.model.publish_api import Names, Origin
from broker.model.vhost import VHost
from broker.mqtt import props as PR
from broker.mqtt.durable import Key, PendingWill
from broker.mqtt.mapping import amqp_props, to_routing_key

if TYPE_CHECKING:
    from broker.mqtt.session import Registry

log = logging.getLogger(__name__)


def publish(vh: VHost, exchange: str, client_id: str, topic: str, payload: bytes, qos: int, retain: bool,
            props: PR.Props, origin: str | None = None, who: Origin | None = None) -> PublishOutcome | None:
    """Through the one publish operation: what happened; None when it did not happen (refused:
    the client is told so). ``who``: the client publishing, for the firehose (None: a will)."""
    req = PublishRequest(exchange, to_routing_key(topic), amqp_props(qos, retain, props, origin), payload,
                         int(time.time() * 1000), persistent=qos > 0, origin=who)
    try:
        out = vh.publish(req)
    except errors.SkredError as exc:
        log.warning("MQTT client '%s': publish to '%s' refused: %s", client_id, topic, exc)
        return None
    if out.rejected:
        return None
    return out


def publish_run(vh: VHost, exchange: str, topic: str, payloads: list[bytes], qos: int,
                origin: str | None) -> PublishOutcome | None:
    """QoS 0 or 1 messages without properties or retain flag, in a row to one topic, through the one
    publish operation at once (``VHost.publish_run``): what happened, or None when that
    operation does not take them as a run or refuses them (the caller then publishes them one
    by one, each answered as ``publish`` answers it: a refusal writes nothing, section "full
    disk" of ``publish_run``)."""
    rk = to_routing_key(topic)
    size = len(payloads[0])
    same = all(len(b) == size for b in payloads)
    props = amqp_props(qos, False, None, origin)
    try:
        return vh.publish_run(exchange, rk, _names(exchange, rk), [props] * len(payloads), payloads, same,
                              int(time.time() * 1000))
    except (errors.SkredError, OSError):
        return None


@lru_cache(maxsize=1024)
def _names(exchange: str, routing_key: str) -> Names:
    """The encoded names of a run's exchange and routing key (a publisher repeats its topics)."""
    return Names(exchange, routing_key)


def arm_will(registry: Registry, key: Key, pending: PendingWill) -> None:
    """Publish a will when it is due (at once when overdue), unless its client comes back first
    (``MQTTSession.start`` cancels it); a kept will is forgotten once sent."""

    def fire() -> None:
        registry.delayed_wills.pop(key, None)
        state = registry.states.by_key.get(key)
        if state is not None and state.will is not None:
            state.will = None
            try:
                registry.states.save(key, state)
            except OSError as exc:
                log.warning("MQTT client '%s': its sent will stays on record: %s", key[1], exc)
        send_will(registry, key, pending)

    delay = pending.due - time.time()
    if delay <= 0:
        fire()
    else:
        registry.delayed_wills[key] = registry.call_later(delay, fire)


def send_will(registry: Registry, key: Key, pending: PendingWill) -> None:
    """Publish a will as its user, if the user may still write its topic."""
    w, ex = pending.will, registry.settings.exchange
    vh, users = registry.vhosts.get(key[0]), registry.users
    user = users.get(pending.username)
    if vh is None or user is None or not (users.can_write(user, vh.name, ex) and users.topic_allows(
            user, vh.name, ex, "write", to_routing_key(w.topic))):
        log.warning("MQTT will of '%s' not published: its user or vhost is gone or may not write to '%s'",
                    key[1], w.topic)
        return
    if w.retain:
        try:
            registry.retained.set(vh.name, w.topic, w.qos, w.message)
        except OSError as exc:
            log.warning("MQTT will of '%s' not retained: %s", key[1], exc)
    publish(vh, ex, key[1], w.topic, w.message, w.qos, w.retain, w.props)
