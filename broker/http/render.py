"""Model objects as RabbitMQ management API JSON (field names as RabbitMQ 3.x uses them)."""

from __future__ import annotations

import base64
import datetime
import decimal
import hashlib
import urllib.parse
from typing import TYPE_CHECKING, Any

from broker import properties
from broker.model import queue_types
from broker.model.exchange import Exchange
from broker.model.queue import Queue
from broker.model.vhost import VHost
from broker.tls import NO_TLS_FIELDS

if TYPE_CHECKING:
    from broker.http.state import Mgmt
    from broker.views import ChannelView, ConnectionView, ConsumerView


def jsonable(value: Any) -> Any:
    """AMQP field values (bytes, Decimal, datetime, nested tables) as JSON values."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, bytes | bytearray | memoryview):
        raw = bytes(value)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return base64.b64encode(raw).decode("ascii")
    if isinstance(value, decimal.Decimal):
        return float(value)
    if isinstance(value, datetime.datetime):
        return int(value.timestamp())
    return value


# Basic properties: management API name -> pamqp attribute (what a publish takes, a get shows)
PROPERTY_FIELDS = {"content_type": "content_type", "content_encoding": "content_encoding",
                   "headers": "headers", "delivery_mode": "delivery_mode", "priority": "priority",
                   "correlation_id": "correlation_id", "reply_to": "reply_to",
                   "expiration": "expiration", "message_id": "message_id", "timestamp": "timestamp",
                   "type": "message_type", "user_id": "user_id", "app_id": "app_id"}
_API_NAMES = {v: k for k, v in PROPERTY_FIELDS.items()}


def properties_json(raw: bytes) -> dict[str, Any]:
    """A message's basic properties as the management API shows them (only those that are set)."""
    if len(raw) < 2:
        return {}
    try:
        p = properties.decode(raw)
    except Exception:  # noqa: BLE001 - odd properties from a client: show none rather than fail
        return {}
    return {_API_NAMES[k]: jsonable(v) for k, v in dict(p).items() if k in _API_NAMES and v not in (None, "")}


def payload_json(shown: bytes, encoding: str) -> dict[str, str]:
    """A (truncated) body as the management API shows it: a UTF-8 string when it decodes and
    ``encoding`` is ``auto``, else base64."""
    if encoding == "auto":
        try:
            return {"payload": shown.decode("utf-8"), "payload_encoding": "string"}
        except UnicodeDecodeError:
            pass
    return {"payload": base64.b64encode(shown).decode("ascii"), "payload_encoding": "base64"}


def rate(value: float) -> dict[str, float]:
    return {"rate": round(value, 2)}


def queue_json(mgmt: Mgmt, q: Queue) -> dict[str, Any]:
    ready = q.message_count
    unacked = q.store.unacked_count
    r = mgmt.rates.queue_rates(q)
    utilisation = mgmt.rates.consumer_utilisation(q)
    exclusive_consumer = next((c.tag for c in q.consumers if c.exclusive), None)
    policy: str | None = None
    operator_policy: str | None = None
    effective: dict[str, Any] = {}
    vh = mgmt.broker.vhosts.get(q.vhost)
    if vh is not None:
        kind = "stream" if queue_types.type_of(q.arguments) == queue_types.STREAM else "queue"
        pol, op = vh.policy_set.for_queue(q.name, kind)
        policy = pol.name if pol is not None else None
        operator_policy = op.name if op is not None else None
        effective = effective_definition(pol.definition if pol else {}, op.definition if op else {})
    out: dict[str, Any] = {
        "name": q.name,
        "vhost": q.vhost,
        "durable": q.durable,
        "auto_delete": q.auto_delete,
        "exclusive": q.exclusive_owner is not None,
        "arguments": jsonable(q.arguments),
        "type": queue_types.type_of(q.arguments),
        "node": mgmt.node_name,
        "state": "paused" if q.paused else "running",
        "policy": policy,
        "operator_policy": operator_policy,
        "effective_policy_definition": jsonable(effective),
        "consumers": len(q.consumers),
        "consumer_utilisation": utilisation,
        "consumer_capacity": utilisation or 0.0,
        "exclusive_consumer_tag": exclusive_consumer,
        "messages": ready + unacked,
        **message_totals(ready, unacked, r),
        "message_bytes_ready": q.store.bytes_ready,
        "message_stats": queue_message_stats([q], r),
    }
    if out["type"] in (queue_types.QUORUM, queue_types.STREAM):
        # RabbitMQ's replica set of a quorum queue or stream; in Skred every durable queue is
        # replicated to the cluster's ISR (docs/compatibility.md, Queue types)
        members = mgmt.replica_members()
        out.update(leader=mgmt.node_name, members=members, online=members)
    owner = q.exclusive_owner
    if owner is not None and hasattr(owner, "peer"):
        out["owner_pid_details"] = {"name": mgmt.connection_name(owner),  # type: ignore[arg-type]
                                    "peer_host": owner.peer[0], "peer_port": owner.peer[1]}
    return out


def with_rates(counters: dict[str, tuple[int, float]]) -> dict[str, Any]:
    """``{key: (count, rate)}`` as RabbitMQ writes it: ``key: count, key_details: {"rate": r}``."""
    out: dict[str, Any] = {}
    for key, (value, speed) in counters.items():
        out[key] = value
        out[f"{key}_details"] = rate(speed)
    return out


def message_totals(ready: int, unacked: int, r: dict[str, float]) -> dict[str, Any]:
    """A queue's, vhost's or the node's message counts with their rates (``RateSampler``)."""
    return {"messages": ready + unacked, "messages_details": rate(r["ready"] + r["unacked"]),
            "messages_ready": ready, "messages_ready_details": rate(r["ready"]),
            "messages_unacknowledged": unacked, "messages_unacknowledged_details": rate(r["unacked"])}


def queue_message_stats(queues: list[Queue], r: dict[str, float]) -> dict[str, Any]:
    """``message_stats`` of a queue or vhost (sums over its queues) with their rates."""
    delivered = sum(q.n_delivered for q in queues)
    gets = sum(q.n_gets for q in queues)
    no_ack = sum(q.n_gets_no_ack for q in queues)
    return with_rates({key: (value, speed) for key, value, speed in (
                              ("publish", sum(q.n_published for q in queues), r["publish"]),
                              ("deliver_get", delivered, r["deliver_get"]),
                              ("deliver", delivered - gets, r["deliver_get"] - r["get"]),
                              ("get", gets - no_ack, r["get"] - r["get_no_ack"]),
                              ("get_no_ack", no_ack, r["get_no_ack"]),
                              ("get_empty", sum(q.n_get_empty for q in queues), r["get_empty"]),
                              ("ack", sum(q.n_acked for q in queues), r["ack"]),
                              ("redeliver", sum(q.n_redelivered for q in queues), r["redeliver"]))})


def vhost_message_stats(vh: VHost, mgmt: Mgmt) -> dict[str, Any]:
    """A vhost's own publisher-side counters with their rates."""
    r = mgmt.rates.vhost_rates(vh)
    return with_rates({"confirm": (vh.n_confirmed, r["confirm"]),
                       "return_unroutable": (vh.n_returned, r["returned"]),
                       "drop_unroutable": (vh.n_unroutable - vh.n_returned, r["unroutable"] - r["returned"])})


def effective_definition(policy: dict[str, Any], operator: dict[str, Any]) -> dict[str, Any]:
    """A queue's policy and operator policy merged as RabbitMQ reports it: the operator's keys
    are added, and where both set a number the lower (stricter) one is in effect."""
    out = dict(policy)
    for key, value in operator.items():
        mine = out.get(key)
        both_numbers = all(isinstance(v, int) and not isinstance(v, bool) for v in (mine, value))
        out[key] = min(mine, value) if both_numbers else value
    return out


def exchange_json(mgmt: Mgmt, vhost: str, ex: Exchange) -> dict[str, Any]:
    r = mgmt.rates.exchange_rates(ex)
    return {
        "name": ex.name,
        "vhost": vhost,
        "type": ex.type,
        "durable": ex.durable,
        "auto_delete": ex.auto_delete,
        "internal": ex.internal,
        "arguments": jsonable(ex.arguments),
        "policy": None,
        "message_stats": {"publish_in": ex.n_in, "publish_in_details": rate(r["publish_in"]),
                          "publish_out": ex.n_out, "publish_out_details": rate(r["publish_out"])},
        "user_who_performed_action": "rmq-internal" if ex.name in ("",) or ex.name.startswith("amq.")
        else "",
    }


def properties_key(routing_key: str, args: dict[str, Any]) -> str:
    """RabbitMQ's binding id in URLs: the quoted key, plus ``~hash`` of the arguments if any."""
    key = urllib.parse.quote(routing_key, safe="") if routing_key else "~"
    if not args:
        return key
    digest = hashlib.md5(repr(sorted((str(k), repr(v)) for k, v in args.items())).encode(),
                         usedforsecurity=False).digest()
    return (urllib.parse.quote(routing_key, safe="") + "~"
            + base64.urlsafe_b64encode(digest).decode().rstrip("="))


def binding_json(vhost: str, source: str, dest: object, routing_key: str,
                 args: dict[str, Any]) -> dict[str, Any]:
    kind = "queue" if isinstance(dest, Queue) else "exchange"
    return {
        "source": source,
        "vhost": vhost,
        "destination": dest.name if isinstance(dest, Queue | Exchange) else str(dest),
        "destination_type": kind,
        "routing_key": routing_key,
        "arguments": jsonable(args),
        "properties_key": properties_key(routing_key, args),
    }


def vhost_bindings(vh: VHost) -> list[dict[str, Any]]:
    out = []
    for ex in vh.exchanges.values():
        for dest, rk, args in ex.bindings():
            out.append(binding_json(vh.name, ex.name, dest, rk, args))
    return out


def connection_json(mgmt: Mgmt, s: ConnectionView) -> dict[str, Any]:
    host, port = mgmt.local_address(s)
    props = jsonable(s.client_properties)
    tls_fields = s.tls.api_fields() if s.tls is not None else NO_TLS_FIELDS
    return {
        "name": mgmt.connection_name(s),
        "node": mgmt.node_name,
        "vhost": s.vhost,
        "user": s.username,
        "user_who_performed_action": s.username,
        "state": "running",
        "type": "network",
        "protocol": s.protocol,
        "auth_mechanism": s.auth_mechanism or "PLAIN",
        **tls_fields,
        "peer_host": s.peer[0],
        "peer_port": s.peer[1],
        "host": host,
        "port": port,
        "channels": len(s.chs),
        "channel_max": s.channel_max,
        "frame_max": s.frame_max,
        "timeout": s.heartbeat,
        "connected_at": int(s.connected_at * 1000),
        **network_stats([s], mgmt),
        "recv_cnt": s.recv_cnt,
        "send_cnt": s.send_cnt,
        "client_properties": props,
    }


def network_stats(sessions: list[ConnectionView], mgmt: Mgmt) -> dict[str, Any]:
    """recv_oct/send_oct with their rates: of one connection, or summed over a vhost's live
    connections (RabbitMQ also keeps the bytes of closed ones; Skred does not)."""
    out: dict[str, Any] = {}
    for key in ("recv_oct", "send_oct"):
        out[key] = sum(getattr(s, key) for s in sessions)
        out[f"{key}_details"] = rate(sum(mgmt.rates.connection_rates(s)[key] for s in sessions))
    return out


def channel_json(mgmt: Mgmt, s: ConnectionView, chs: ChannelView) -> dict[str, Any]:
    conn = mgmt.connection_name(s)
    return {
        "name": f"{conn} ({chs.id})",
        "number": chs.id,
        "node": mgmt.node_name,
        "vhost": s.vhost,
        "user": s.username,
        "user_who_performed_action": s.username,
        "state": "running" if chs.flow else "flow",
        "connection_details": {"name": conn, "peer_host": s.peer[0], "peer_port": s.peer[1]},
        "consumer_count": len(chs.consumers),
        "messages_unacknowledged": len(chs.unacked),
        "messages_unconfirmed": chs.publish_seq - chs.confirmed if chs.confirm else 0,
        "messages_uncommitted": sum(1 for op in chs.tx or () if op[0] == "publish"),
        "acks_uncommitted": sum(1 for op in chs.tx or () if op[0] != "publish"),
        "prefetch_count": chs.prefetch,
        "global_prefetch_count": chs.global_prefetch,
        "pending_raft_commands": 0,  # RabbitMQ's quorum-queue commands in flight: no Raft here
        "confirm": chs.confirm,
        "transactional": chs.tx is not None,
    }


def consumers_json(mgmt: Mgmt, s: ConnectionView, chs: ChannelView) -> list[dict[str, Any]]:
    return [consumer_json(mgmt, s, c, chs.id) for c in chs.consumers.values()]


def consumer_json(mgmt: Mgmt, s: ConnectionView, c: ConsumerView, channel: int) -> dict[str, Any]:
    """One consumer; ``channel`` 0: a front end's consumer with no channel (a stream subscription)."""
    conn = mgmt.connection_name(s)
    return {
        "consumer_tag": c.tag,
        "queue": {"name": c.queue.name, "vhost": c.queue.vhost},
        "ack_required": not c.no_ack,
        "exclusive": c.exclusive,
        "prefetch_count": c.prefetch,
        "active": True,
        "activity_status": "up",
        "arguments": jsonable(c.arguments),
        "channel_details": {
            "name": f"{conn} ({channel})", "number": channel, "connection_name": conn,
            "peer_host": s.peer[0], "peer_port": s.peer[1], "user": s.username, "node": mgmt.node_name,
        },
    }
