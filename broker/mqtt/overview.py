"""MQTT sessions as the management API shows them (``views.SessionsView``).

A session is known in one of two ways: it is connected (the registry holds its ``MQTTSession``),
or it is a persistent session whose client is away: its durable subscription queues
(``mqtt-subscription-<client id>qos0`` / ``qos1``) are in the vhost, bound to the MQTT exchange,
and ``durable.SessionStates`` may keep its shared subscriptions and a will waiting out its delay.
Both are read here, never changed; a disconnected session's filters are its queues' binding keys
turned back into MQTT filters, their QoS that of the queue, as the session made them.
"""

from __future__ import annotations

from typing import Any

from broker.model.vhost import VHost
from broker.mqtt import props as PR
from broker.mqtt.mapping import to_filter
from broker.mqtt.packets import Will
from broker.mqtt.session import MQTTSession, Registry

QUEUE_PREFIX = "mqtt-subscription-"
_SUFFIXES = ("qos0", "qos1")


def _will(w: Will | None, due: float | None = None) -> dict[str, Any] | None:
    if w is None:
        return None
    out: dict[str, Any] = {"topic": w.topic, "qos": w.qos, "retain": w.retain,
                           "payload_bytes": len(w.message), "delay": w.props.get(PR.WILL_DELAY, 0)}
    if due is not None:
        out["due"] = due  # Unix time a delayed will goes out unless the client comes back
    return out


def _sub(topic_filter: str, options: int, sub_id: int) -> dict[str, Any]:
    """One subscription: QoS 2 is granted as 1 (``session.py``); the client asked ``requested_qos``."""
    return {"filter": topic_filter, "qos": min(options & 3, 1), "requested_qos": options & 3,
            "subscription_id": sub_id or None}


def _queues(vh: VHost, client_id: str) -> list[tuple[int, Any]]:
    return [(qos, q) for qos, suffix in enumerate(_SUFFIXES)
            if (q := vh.queues.get(f"{QUEUE_PREFIX}{client_id}{suffix}")) is not None]


def _messages(vh: VHost, client_id: str) -> int:
    return sum(q.message_count for _, q in _queues(vh, client_id))


def _live(s: MQTTSession, level: int) -> dict[str, Any]:
    assert s.vhost is not None
    subs = [_sub(f, opts, sid) for f, (opts, sid) in sorted(s.filters.items())]
    return {
        "vhost": s.vhost.name, "client_id": s.client_id, "connected": True,
        "clean_session": not s.durable, "session_expiry_interval": s.session_expiry if s.v5 else None,
        "protocol_level": level, "user": s.user.name if s.user is not None else "",
        "peer_host": s.peer, "subscriptions": subs, "will": _will(s.will), "in_flight": len(s.inflight),
        "in_flight_max": s.in_flight_max, "messages": _messages(s.vhost, s.client_id),
    }


def _away(vh: VHost, client_id: str, exchange: str, registry: Registry) -> dict[str, Any]:
    ex = vh.exchanges.get(exchange)
    subs: list[dict[str, Any]] = []
    for qos, q in _queues(vh, client_id):
        for key, _args in ex.bindings_of(q) if ex is not None else ():
            subs.append(_sub(to_filter(key), qos, 0))
    state = registry.states.by_key.get((vh.name, client_id))
    if state is not None:
        subs.extend(_sub(f, opts, sid) for f, (opts, sid) in state.shared.items())
    pending = state.will if state is not None else None
    return {
        "vhost": vh.name, "client_id": client_id, "connected": False, "clean_session": False,
        "session_expiry_interval": None, "protocol_level": None, "user": pending.username if pending else "",
        "peer_host": "", "subscriptions": sorted(subs, key=lambda d: d["filter"]),
        "will": _will(pending.will, pending.due) if pending else None, "in_flight": 0,
        "in_flight_max": 0, "messages": _messages(vh, client_id),
        "expires_at": state.expires_at or None if state is not None else None,
    }


def sessions(registry: Registry, vhosts: dict[str, VHost], exchange: str,
             levels: dict[tuple[str, str], int]) -> list[dict[str, Any]]:
    """Every session: the connected ones (``levels``: their connections' protocol levels), then
    the persistent ones whose client is away."""
    out = [_live(s, levels.get(key, 4)) for key, s in registry.sessions.items() if not s.closed]
    seen = set(registry.sessions)
    away: set[tuple[str, str]] = set()
    for vh in vhosts.values():
        for name, q in vh.queues.items():
            if name.startswith(QUEUE_PREFIX) and q.durable and name.endswith(_SUFFIXES):
                away.add((vh.name, name[len(QUEUE_PREFIX):-len(_SUFFIXES[0])]))
    away.update(k for k in registry.states.by_key if k[0] in vhosts)
    for key in sorted(away - seen):
        out.append(_away(vhosts[key[0]], key[1], exchange, registry))
    return out
