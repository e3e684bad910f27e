"""MQTT sessions as the management API shows them (``views.SessionsView``).

A session is known in one of two ways: it is connected (the registry holds its ``MQTTSession``),
or it is a persistent session whose client is away: its durable subscription queues
(``mqtt-subscription-<client id>qos0`` / ``qos1``) are in the vhost, bound to the MQTT exchange,
and ``durable.SessionStates`` may keep its shared subscriptions and a will waiting out its delay.
Both are read here, never changed; a disconnected session's filters are its queues' binding keys
turned back into MQTT filters, their QoS that of the queue, as the session made them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from broker.model.vhost import VHost
from broker.mqtt import props as PR
from broker.mqtt.durable import SessionState
from broker.mqtt.mapping import to_filter
from broker.mqtt.packets import Will
from broker.mqtt.session import MQTTSession, Registry
from broker.views import SessionEntry

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


def entries(registry: Registry, vhosts: dict[str, VHost], vhost: str | None = None) -> list[SessionEntry]:
    """Every session (of ``vhost``, or of all), unrendered and in no particular order: the
    connected ones, then the persistent ones whose client is away, found by their subscription
    queues' names and the kept states (no binding is read, nothing is built but the entry: one
    pass over the queue names, about 15 ms of CPU for 10,000 sessions)."""
    out = [(vh.name, s.client_id, True, s.user.name if s.user is not None else "")
           for s in registry.sessions.values()
           if not s.closed and (vh := s.vhost) is not None and (vhost is None or vh.name == vhost)]
    seen: set[tuple[str, str]] = set(registry.sessions)
    states = registry.states.by_key
    start, cut = len(QUEUE_PREFIX), -len(_SUFFIXES[0])
    for vh in vhosts.values() if vhost is None else filter(None, [vhosts.get(vhost)]):
        name_of = vh.name
        for name, q in vh.queues.items():
            if name.startswith(QUEUE_PREFIX) and name.endswith(_SUFFIXES) and q.durable:
                key = (name_of, name[start:cut])
                if key not in seen:  # a session's QoS 0 and QoS 1 queues: once
                    seen.add(key)
                    out.append((name_of, key[1], False, _will_user(states.get(key))))
    for key, state in states.items():
        if key not in seen and key[0] in vhosts and (vhost is None or key[0] == vhost):
            out.append((key[0], key[1], False, _will_user(state)))
    return out


def _will_user(state: SessionState | None) -> str:
    """Whom an away session's pending will names (the user an away session is shown as)."""
    pending = state.will if state is not None else None
    return pending.username if pending is not None else ""


def session(registry: Registry, vhosts: dict[str, VHost], exchange: str, level: Callable[[MQTTSession], int],
            vhost: str, client_id: str) -> dict[str, Any] | None:
    """One session rendered (``level``: its connection's protocol level), connected or away;
    None when there is no such session."""
    live = registry.sessions.get((vhost, client_id))
    if live is not None and not live.closed and live.vhost is not None:
        return _live(live, level(live))
    vh = vhosts.get(vhost)
    if vh is None or not (_queues(vh, client_id) or (vhost, client_id) in registry.states.by_key):
        return None
    return _away(vh, client_id, exchange, registry)
