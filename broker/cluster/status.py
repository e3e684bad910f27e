"""Cluster status: live view (metrics, ``GET /api/cluster``), follower metrics, ``--cluster-status``.

Theory of operation
-------------------
``ClusterView`` is owned by the runner and updated as the node changes role;
it reads everything else live (the leader's ``LeaderSink``: connected
followers, their lag in bytes sent-or-held but not acked, the ISR) so a scrape
or an API call never sees a stale copy. It implements ``broker.metrics.ClusterInfo``;
the runner hands it to the leader broker it boots, whose metrics and
management API read it.

A follower runs no broker and its management port is a proxy to the leader, so
``GET /api/cluster`` on any node shows the leader's view. Its metrics port,
however, is its own: the host's follower metrics server (``broker.metrics.FollowerMetrics``)
serves the cluster gauges there (``skred_is_leader 0``) while the node follows.

``skred --cluster-status`` asks etcd only (it works while no node serves):
the leader key, the ISR key, and the lease-bound member records every node
publishes (the leader's record includes its followers' lag). With
``[clustering] shard_leaders`` both also show each shard's leader (its etcd key
``<prefix>/shards/<quoted vhost>/leader``, ``broker/shards/leaders.py``) and
how many shards each node leads.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from broker.cluster.etcd import SHARDS, Etcd, EtcdError, shard_holder, shard_isrs, shard_of_key
from broker.config import Config

if TYPE_CHECKING:
    from broker.cluster.leader import LeaderSink

log = logging.getLogger(__name__)


class ClusterView:
    def __init__(self, node_id: str, uri: str) -> None:
        self.node_id = node_id
        self.uri = uri
        self.role = "starting"  # starting | follower | candidate | leader
        self.leader_uri: str | None = None
        self.sink: LeaderSink | None = None  # set while leading
        self.synced = False  # follower: first bulk sync completed
        self.warm = False  # this process has followed in sync or led: its files are complete
        self.last: dict[str, Any] = {}  # our role and term when we last followed or led (standing.py)
        self.since = time.time()
        self.weight: int | None = None  # per-shard leaders: our worker count, in our member record
        self.shards: dict[str, dict[str, Any]] | None = None  # per-shard leaders: vhost -> leader
        self.draining = False  # per-shard leaders: stopping, our shards are being handed over
        self.app: Any = None  # the runner's stop_app/start_app (http/routes_app.py AppControl)

    def set_role(self, role: str, leader_uri: str | None = None, sink: LeaderSink | None = None) -> None:
        if role != self.role:
            self.since = time.time()
        self.role = role
        self.leader_uri = leader_uri
        self.sink = sink

    # ---------------------------------------------------------- ClusterInfo
    def is_leader(self) -> bool:
        return self.role == "leader" and self.sink is not None and not self.sink.fenced

    def follower_lags(self) -> dict[str, int]:
        sink = self.sink if self.role == "leader" else None
        return {} if sink is None else {f.node_id: f.lag for f in sink.followers.values()}

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"enabled": True, "node_id": self.node_id, "uri": self.uri,
                               "role": self.role, "since": self.since}
        if self.shards is not None:
            out["shards"] = [{"vhost": v, **s} for v, s in sorted(self.shards.items())]
            out["shards_led"] = sum(1 for s in self.shards.values() if s.get("leader") == self.node_id)
        sink = self.sink if self.role == "leader" else None
        if sink is None:
            out["leader"] = {"uri": self.leader_uri}
            out["synced"] = self.synced
            return out
        out["leader"] = {"node_id": self.node_id, "uri": self.uri}
        out["fenced"] = sink.fenced
        out["isr"] = sorted([self.node_id, *sink.isr])
        out["followers"] = [
            {"node_id": f.node_id, "peer": f.peer, "lag_bytes": f.lag, "sent_bytes": f.sent,
             "acked_bytes": f.acked, "synced": f.synced, "in_isr": f.node_id in sink.isr}
            for f in sorted(sink.followers.values(), key=lambda f: f.node_id)]
        out["refused_followers"] = sink.refused
        return out

    def member_record(self) -> dict[str, Any]:
        """What this node publishes under ``<prefix>/members/<id>`` (lag rounded: fewer etcd writes)."""
        record: dict[str, Any] = {"uri": self.uri, "role": self.role, "warm": self.warm}
        if self.last:
            record["last"] = self.last
        lags = self.follower_lags()
        if lags:
            record["lag_bytes"] = {k: _coarse(v) for k, v in lags.items()}
        if self.weight is not None:
            record["workers"] = self.weight
        if self.draining:
            record["draining"] = True
        return record


def _coarse(n: int) -> int:
    """``n`` rounded down to two significant digits: a record changes only when lag really moves."""
    if n < 100:
        return n
    scale = int(10 ** (len(str(n)) - 2))
    return n // scale * scale


# ------------------------------------------------------------ skred --cluster-status
async def read_status(config: Config) -> dict[str, Any]:
    """The cluster as etcd sees it: leader, ISR, live members (raises EtcdError)."""
    c = config.clustering
    etcd = Etcd(c.etcd_endpoints, c.etcd_prefix, c.lease_ttl)
    await etcd.connect()
    try:
        leader = await etcd.get("leader")
        isr, _raw = await etcd.read_isr()
        members = await etcd.members()
        shard_keys = await etcd.get_prefix(SHARDS)
    finally:
        await etcd.close()
    leader_uri = leader.decode(errors="replace") if leader is not None else None
    leader_id = next((nid for nid, m in members.items() if m.get("uri") == leader_uri), None)
    lags: dict[str, Any] = {}
    if leader_id is not None:
        lags = dict(members[leader_id].get("lag_bytes") or {})
    nodes = []
    for nid in sorted(set(members) | set(isr or [])):
        m = members.get(nid, {})
        nodes.append({"node_id": nid, "uri": m.get("uri"), "role": m.get("role", "down"),
                      "in_isr": nid in (isr or []), "lag_bytes": lags.get(nid)})
    out: dict[str, Any] = {"etcd": c.etcd_endpoints, "prefix": etcd.prefix,
                           "leader": {"node_id": leader_id, "uri": leader_uri}, "isr": isr or [],
                           "members": nodes}
    if c.shard_leaders or shard_keys:  # the nodes elect per shard (whatever this command was told)
        shards = {vhost: shard_holder(raw) for key, (raw, _term) in shard_keys.items()
                  if (vhost := shard_of_key(key)) is not None}
        isrs = shard_isrs(shard_keys)  # a shard without a leader right now is listed too
        out["shards"] = [{"vhost": v, "leader": shards.get(v), "isr": isrs.get(v)}
                         for v in sorted(set(shards) | set(isrs))]
        for node in nodes:
            node["shards_led"] = sum(1 for n in shards.values() if n == node["node_id"])
    return out


def format_status(status: dict[str, Any]) -> str:
    leader = status["leader"]
    lines = [f"cluster {status['prefix']!r} (etcd {status['etcd']})",
             f"leader: {leader['node_id'] or '?'} {leader['uri'] or '(none)'}",
             f"ISR:    {', '.join(status['isr']) or '(none)'}", ""]
    rows = [("NODE", "URI", "ROLE", "IN ISR", "LAG BYTES")]
    for m in status["members"]:
        lag = m["lag_bytes"]
        rows.append((m["node_id"], m["uri"] or "-", m["role"], "yes" if m["in_isr"] else "no",
                     "-" if lag is None else str(lag)))
    lines += _table(rows)
    if "shards" in status:
        led = ", ".join(f"{m['node_id']} {m['shards_led']}" for m in status["members"])
        lines += ["", f"shard leaders ({led}):"]
        lines += _table([("VHOST", "LEADER", "ISR"),
                         *((s["vhost"], s["leader"] or "-", ", ".join(s.get("isr") or ()) or "-")
                           for s in status["shards"])])
    return "\n".join(lines)


def _table(rows: Sequence[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def cluster_status_main(config: Config, as_json: bool) -> int:
    """``skred --cluster-status``: print the cluster table (or JSON); 1 if etcd cannot be read."""
    try:
        status = asyncio.run(read_status(config))
    except EtcdError as exc:
        print(f"skred: error: cannot read cluster status from etcd {config.clustering.etcd_endpoints}: {exc}",
              file=sys.stderr)
        return 1
    print(json.dumps(status, indent=2) if as_json else format_status(status))
    return 0
