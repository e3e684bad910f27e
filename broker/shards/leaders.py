"""Per-shard leadership across the nodes of a cluster (``[clustering] shard_leaders``).

Theory of operation
-------------------
Today's cluster elects one leader for everything (``broker/cluster/runner.py``): three nodes
have the capacity of one. The unit of ownership is instead the *shard* (``placement.ShardId``:
a vhost now, a super stream's partition later), and every shard has a leader of its own.

Placement. Every node publishes a lease-bound member record in etcd that carries its weight
(its worker count). The *preferred* node of a shard is ``placement.node_of``: weighted
rendezvous hashing over every ``(node, worker)`` pair of the live members, so anyone who reads
the member keys computes the same map with no coordination, and a node that joins or leaves
moves only the shards it wins or held (about 1/N), never the others.

Election, per shard. ``<prefix>/shards/<quoted vhost>/leader`` is created (a transaction:
"create if absent") bound to the campaigning node's lease, value = its node id and URI; its
create revision is the shard's term. Only one node campaigns for a shard: the preferred node
among the *eligible* ones, those live (a member record) and in sync (its member record says
``warm``, it has synced or led in this process, and the shard's ISR key
``<prefix>/shards/<quoted vhost>/isr`` names it; the cluster's ISR key for a shard that has
none yet; any warm node while neither exists). The shard ISR keys are written by the node
replicating the shard's data, in the same fenced transaction as the cluster's ISR
(``Etcd.write_isr``): a failover goes only to a node that holds the shard's confirmed messages.
So placement is deterministic, yet failover still works: when the preferred node dies its
lease expires, its member record and every shard key it held vanish together, and on its
next pass (``PASS`` seconds) each survivor computes the
placement over the members that remain and the new preferred node campaigns at once: a
shard fails over within the TTL plus a pass. Racing views (two nodes briefly disagreeing on
the members) cannot give a shard two leaders: the create transaction lets one win, and a
winner that is not the preferred node resigns on a later pass.

Hand-back. A node that comes back is live at once but not eligible until it is in sync (the
ISR names it again after its bulk sync). From then on it is the preferred node of the shards
it held, and their current leader resigns them: it deletes its key guarded by its own create
revision (never a successor's), and the preferred node creates it on its next pass. Until it
is in sync the stand-in keeps leading, so a shard is never handed to a node that lacks its
confirmed messages. A key of a vhost that was deleted is resigned the same way; a key our
own previous run left (our node id, a term we did not win in this run) is deleted at once
rather than left to a TTL.

Drain. On SIGTERM/SIGINT a node gives its shards away before it stops anything else: it marks
its member record ``draining`` (peers leave it out of the placement from their next pass), then
resigns every shard it holds (the same guarded delete) and runs ``on_leader_lost`` for each, so
its shards are led again within a pass or two, not left to its lease or to the cluster
leader's replication drain. The pass loop is stopped first, by a cancel; the runner waits for
it a bounded time only, and the loop and its campaigns also end once ``drain`` marks the node
draining, so a lost cancel (``broker/cluster/etcd.py``, "Cancels") cannot hold the drain back.

Behind. A holder its shard's ISR key no longer names hands the shard to one it does, but not
at once when it is the shard's preferred live node: it keeps the key for ``BEHIND_GRACE``
seconds, and keeps it for good if it is named again by then. A new cluster leader writes every
ISR key it replicates as itself alone, and each other node rejoins after its bulk sync from it;
resigning at once moved every shard the other follower led twice (away, and back after its
sync) on each change of cluster leader, a drain included. Keeping a key is never a risk to a
confirmed message: a failover still campaigns only inside the ISR, and a holder opens a shard
only from its ISR or a release (``cluster/handover.py``).

Hooks. ``on_leader_elected`` / ``on_leader_lost`` run per shard as well, with ``SKRED_SHARD``
naming the vhost.

Scope in this release (the switch is off by default until the per-shard mode has proven
itself across the suite; docs/architecture.md, "Per-shard leaders", has the plan):

* What is per shard now: the election, the placement, failover (only into the shard's ISR
  key), hand-back, the hooks and the status (``skred --cluster-status``, ``GET
  /api/cluster``). While one stream (the cluster leader's) carries every shard, each shard ISR
  key names the cluster's ISR less the members behind on that shard, and that shard's confirms
  wait for those alone (``broker/cluster/shard_sink.py``); they part for real once each shard's
  leader replicates its own shard.
* What is not yet: the data path. Clients are still served by the cluster leader (the node
  holding ``<prefix>/leader``) and replicated by its single stream; a follower's AMQP proxy
  already routes each connection by the vhost of its ``connection.open``
  (``cluster/vhost_route.py``), to the cluster leader for every vhost for now. Built for the
  next step: a replication connection carries a scope (``cluster/files.py`` ``Scope``) and a
  follower follows each node serving shards for those alone (``cluster/follow_set.py``); a
  shard leader key whose value says ``"serves": true`` names that node (``serving``), and the
  router sends the vhost's clients there. Nothing writes it yet: the node leading a shard
  serves it (a broker holding only its shards, as a worker does on one node); a follower's
  proxy chooses the tunnel per shard once the vhost is known (for AMQP after
  ``connection.open``, as the worker hand-over does), while protocols that cannot know the
  vhost before routing (MQTT, the stream protocol's first frames, HTTP) stay with the leader
  of the default vhost's shard.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from broker.auth.vhosts import FILE_NAME as VHOSTS_FILE
from broker.cluster.etcd import (
    SHARDS,
    Etcd,
    EtcdError,
    shard_holder,
    shard_isr_values,
    shard_isrs,
    shard_key,
    shard_of_key,
    shard_released,
    shard_server,
)
from broker.cluster.files import shard_name
from broker.cluster.handover import Seen
from broker.cluster.hooks import run_hook
from broker.cluster.shard_sink import ShardedLeaderSink
from broker.cluster.status import ClusterView
from broker.config import Config
from broker.errors import StoreError
from broker.shards.placement import node_of, vhost_shard
from broker.store.jsonstore import read_json

log = logging.getLogger(__name__)

PASS = 0.25  # seconds between passes: bounds failover (after the TTL) and hand-back
# seconds a holder out of its shard's ISR keeps the shard while it is the shard's preferred
# live node ("Behind"): a catch-up after a change of cluster leader is a compare of files that
# mostly match, seconds even on a loaded machine; one stuck longer (a full disk) hands it over
BEHIND_GRACE = 15.0


class Action(Enum):
    WAIT = "wait"  # someone else should (or does) lead it
    CAMPAIGN = "campaign"  # nobody leads it and we are its preferred eligible node
    KEEP = "keep"  # we lead it and should
    RESIGN = "resign"  # we lead it, and its preferred node is live and in sync: hand it back


def in_sync(members: Mapping[str, Mapping[str, Any]], isr: list[str] | None) -> set[str]:
    """The members in sync: warm (the record says this process has synced or led) and named by
    the ISR (any warm member while no ISR exists). The ISR alone is not enough: a node that died
    stays in it until the leader's ack timeout drops it, and one that restarts within that time
    is live and named, yet holds nothing new."""
    warm = {n for n, m in members.items() if m.get("warm") is True}
    return warm if isr is None else set(isr) & warm


def replicated_here(vhosts: list[str], serving: Mapping[str, str], uri: str) -> list[str]:
    """Of ``vhosts``, those the cluster leader (replication URI ``uri``) replicates: every one
    but those another node serves (``serving``: vhost directory -> its server's URI)."""
    return [v for v in vhosts if serving.get(shard_name(v), uri) == uri]


def live_nodes(members: Mapping[str, Mapping[str, Any]]) -> dict[str, int]:
    """The nodes shards may be placed on (node id -> weight): every member but a draining one."""
    return {n: _weight(m) for n, m in members.items() if m.get("draining") is not True}


def eligible(live: Mapping[str, int], isr: set[str] | None) -> dict[str, int]:
    """The live nodes that may lead a shard (in sync: in the ISR, or any while none exists)."""
    return {n: w for n, w in live.items() if isr is None or n in isr}


@functools.lru_cache(maxsize=1 << 16)
def _preferred(vhost: str, nodes: tuple[tuple[str, int], ...]) -> str:
    return node_of(vhost_shard(vhost), dict(nodes))


def preferred(vhost: str, nodes: Mapping[str, int]) -> str | None:
    """The preferred node of ``vhost``'s shard among ``nodes`` (None: no node). Cached: a pass
    asks for every vhost four times a second, and the members rarely change."""
    return _preferred(vhost, tuple(sorted(nodes.items()))) if nodes else None


def decide(me: str, vhost: str, holder: str | None, live: Mapping[str, int],
           isr: set[str] | None, patient: bool = False) -> Action:
    """What node ``me`` does for ``vhost``'s shard, led by ``holder`` (None: nobody), given the
    live nodes (node id -> worker count) and the ISR (None: not written yet). ``patient``: we
    hold it, fell out of its ISR less than ``BEHIND_GRACE`` ago, and keep it while we are its
    preferred live node (see "Behind")."""
    best = preferred(vhost, eligible(live, isr))
    if holder is None:
        return Action.CAMPAIGN if best == me else Action.WAIT
    if holder != me:
        return Action.WAIT
    if best in (None, me) or (patient and preferred(vhost, live) == me):
        return Action.KEEP
    return Action.RESIGN


@dataclass
class Held:
    """A shard this node leads: the term (create revision) it won it with."""

    term: int


class ShardLeaders:
    """The per-shard election loop of one cluster node (see the theory of operation)."""

    def __init__(self, config: Config, etcd: Etcd, node_id: str, uri: str, view: ClusterView,
                 workers: int = 1) -> None:
        self.config = config
        self.etcd = etcd
        self.node_id = node_id
        self.uri = uri
        self.view = view
        self.workers = workers
        self.vhosts_path: Path = config.main.data_dir / VHOSTS_FILE
        self.held: dict[str, Held] = {}
        self._lease: int | None = None
        self._vhosts: list[str] = []
        self._serving: dict[str, str] = {}  # shard (vhost directory) -> URI of the node serving it
        self._seen: dict[str, Seen] = {}  # vhost -> its keys as the last pass read them
        self._behind: dict[str, float] = {}  # vhost we hold -> when we found its ISR without us
        self._ready = False
        self._members: dict[str, dict[str, Any]] = {}  # the live members' records, as last read
        self.closed: set[str] = set()  # vhosts the cluster leader's broker closed: their keys are not ours
        self._bg: set[asyncio.Task[Any]] = set()
        view.weight = workers

    async def run(self) -> None:
        said = ""  # the unexpected failure last logged (a pass runs 4 times a second)
        while not self.view.draining:  # stopped by a cancel; by ``drain`` too, should one be lost
            await asyncio.sleep(PASS)
            try:
                await self.pass_once()
            except EtcdError as exc:
                self.etcd.outage.failed(exc)
            except Exception as exc:  # a bug must not end per-shard leadership silently
                if str(exc) != said:
                    said = str(exc)
                    log.error("shard election pass failed: %s: %s", type(exc).__name__, exc, exc_info=True)

    def vhosts(self) -> list[str]:
        """The vhost names in this node's data dir (replicated on a follower); the last good
        list while the file is being replaced or unreadable."""
        try:
            data = read_json(self.vhosts_path, None)
            if data is not None:
                self._vhosts = sorted({str(v["name"]) for v in data["vhosts"]})
        except (OSError, ValueError, KeyError, TypeError, StoreError) as exc:  # mid-replacement
            log.debug("shard list unreadable for now: %s", exc)
        return self._vhosts

    def replicated(self) -> list[str]:
        """The vhosts whose ISR keys the cluster leader writes: those no other node serves."""
        return [v for v in replicated_here(self.vhosts(), self._serving, self.uri) if v not in self.closed]

    def serving(self) -> dict[str, str]:
        """The shards whose leader serves them (its key says so), by vhost directory, with that
        leader's replication URI: a follower takes each from the node serving it
        (``cluster/follow_set.py`` ``follow_plan``). As of the last pass."""
        return self._serving

    def live_members(self) -> dict[str, dict[str, Any]]:
        """Every live member's record by node id, as the last pass read them."""
        return self._members

    def ready(self) -> bool:
        """A pass has read the shards' keys since this node started (``seen`` is meaningful)."""
        return self._ready

    def seen(self) -> dict[str, Seen]:
        """Each shard's keys as the last pass read them (the hand-over's input, ``cluster/handover.py``)."""
        return self._seen

    def term_of(self, vhost: str) -> int | None:
        """Our term of ``vhost``'s shard (None: we do not lead it)."""
        held = self.held.get(vhost)
        return held.term if held is not None else None

    async def mark_served(self, vhost: str) -> bool:
        """Say in ``vhost``'s leader key that we serve it (only the key we created)."""
        held = self.held.get(vhost)
        if held is None:
            return False
        value = json.dumps({"node_id": self.node_id, "uri": self.uri, "serves": True}, sort_keys=True)
        return await self.etcd.put_if(shard_key(vhost), held.term, value.encode())

    async def pass_once(self) -> None:
        if self.etcd.client is None or self.etcd.lease_id is None:
            return
        if self.etcd.lease_id != self._lease:  # a new lease: every key of the old one is gone
            self._lease = self.etcd.lease_id
            self._lost(list(self.held), "our lease changed")
        if not self.etcd.lease_alive():  # unrefreshed for a TTL: etcd may have expired our keys
            self._lost(list(self.held), "our lease is presumed expired")
            return
        members = self._members = await self.etcd.members()
        if self.node_id not in members:
            return  # peers cannot see us yet: they would not place a shard on us
        live = live_nodes(members)
        isr_list, isr_raw = await self.etcd.read_isr()
        keys = await self.etcd.get_prefix(SHARDS)
        isrs = shard_isrs(keys)  # a shard without its own ISR key yet goes by the cluster's
        vhosts = self.vhosts()
        self._serving = {shard_name(v): uri for v in vhosts if (found := keys.get(shard_key(v))) is not None
                         and (uri := shard_server(found[0])) is not None}
        if self.view.is_leader() and isr_raw is not None and isr_list is not None:
            # we replicate every shard no other node serves, so each one's ISR is the cluster's
            # less the members behind on it (ShardedLeaderSink): a vhost created since the last
            # ISR write gets its key, a deleted one's goes, a stray value is mended; the key of a
            # shard served elsewhere is its server's alone
            values = shard_isr_values(keys)
            sink = self.view.sink
            ours = [v for v in replicated_here(vhosts, self._serving, self.uri) if v not in self.closed]
            want = {v: json.dumps(sink.shard_members(shard_name(v), isr_list)
                                  if isinstance(sink, ShardedLeaderSink) else isr_list).encode()
                    for v in ours}
            await self.etcd.mend_shard_isrs({v: (values.get(v), want[v]) for v in ours
                                             if values.get(v) != want[v]},
                                            [v for v in values if v not in vhosts], isr_raw)
        shown: dict[str, dict[str, Any]] = {}
        seen: dict[str, Seen] = {}
        sink = self.view.sink if self.view.is_leader() else None
        for vhost in vhosts:
            isr = in_sync(members, isrs.get(vhost, isr_list))
            found = keys.get(shard_key(vhost))
            holder, term = (None, 0) if found is None else (shard_holder(found[0]), found[1])
            if holder == self.node_id and vhost not in self.held and term:
                await self.etcd.delete_if(shard_key(vhost), term)  # our previous run's
                holder = None
            if holder != self.node_id and vhost in self.held:
                self._lost([vhost], "its key is gone")
            action = decide(self.node_id, vhost, holder, live, isr, self._patient(vhost, holder, isr))
            if action is Action.CAMPAIGN and not self.view.draining:
                won = await self.etcd.create_bound(shard_key(vhost), self._value())
                if won is not None:
                    self.held[vhost] = Held(won)
                    holder, term = self.node_id, won
                    log.info("shard %r: leading (term %d)", vhost, won)
                    self._hook(self.config.clustering.on_leader_elected, "leader", vhost)
            elif action is Action.RESIGN:
                if await self.etcd.delete_if(shard_key(vhost), self.held[vhost].term):
                    log.info("shard %r: handed back to its preferred node", vhost)
                self._lost([vhost], "handed back")
                holder, term = None, 0
            server = shard_server(found[0]) if found is not None and term == found[1] else None
            seen[vhost] = Seen(holder, term, server, isrs.get(vhost), shard_released(keys, vhost))
            shown[vhost] = {"leader": holder, "term": term or None,
                            "preferred": preferred(vhost, eligible(live, isr))}
            if sink is not None:  # we replicate it: who holds its every action (its own acks)
                shown[vhost]["replicas"] = sink.shard_replicas(shard_name(vhost))
        for key, (_raw, rev) in keys.items():  # keys of vhosts that no longer exist
            gone = shard_of_key(key)
            if gone is not None and gone not in shown and gone in self.held:
                await self.etcd.delete_if(key, rev)
                self._lost([gone], "the vhost was deleted")
        self.view.shards = shown
        self._seen = seen
        self._ready = True

    def _patient(self, vhost: str, holder: str | None, isr: set[str]) -> bool:
        """We hold ``vhost`` and its ISR has left us out for less than ``BEHIND_GRACE`` ("Behind")."""
        if holder != self.node_id or self.node_id in isr:
            self._behind.pop(vhost, None)
            return False
        now = time.monotonic()
        since = self._behind.setdefault(vhost, now)
        if now - since >= BEHIND_GRACE:
            return False
        if since == now:
            log.info("shard %r: its ISR no longer names us; keeping it for up to %.0fs while we catch up",
                     vhost, BEHIND_GRACE)
        return True

    async def drain(self) -> None:
        """Hand every shard over (the node is stopping; the pass loop is no longer running):
        peers stop placing shards here, then each held key is deleted and its hook run."""
        self.view.draining = True
        if not self.held:
            return
        try:
            await self.etcd.put_member(self.node_id, self.view.member_record())
        except EtcdError as exc:  # our lease going away takes the keys anyway
            log.warning("could not mark this node draining: %s", exc)
        hooks = []
        for vhost, held in sorted(self.held.items()):
            try:
                if await self.etcd.delete_if(shard_key(vhost), held.term):
                    log.info("shard %r: handed over (this node is stopping)", vhost)
            except EtcdError as exc:
                log.warning("shard %r: could not resign (the lease will): %s", vhost, exc)
            self.held.pop(vhost, None)  # a pass still in flight may have dropped it
            log.info("shard %r: no longer leading (draining)", vhost)
            hooks.append(run_hook(self.config.clustering.on_leader_lost, self.node_id, self.uri,
                                  "follower", shard=vhost))
        await asyncio.gather(*hooks)

    def _value(self) -> bytes:
        return json.dumps({"node_id": self.node_id, "uri": self.uri}, sort_keys=True).encode()

    def _lost(self, vhosts: list[str], why: str) -> None:
        for vhost in vhosts:
            if self.held.pop(vhost, None) is not None:
                log.info("shard %r: no longer leading (%s)", vhost, why)
                self._hook(self.config.clustering.on_leader_lost, "follower", vhost)

    def _hook(self, command: str, role: str, vhost: str) -> None:
        if not command:
            return
        task = asyncio.ensure_future(run_hook(command, self.node_id, self.uri, role, shard=vhost))
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)


def _weight(record: Mapping[str, Any]) -> int:
    value = record.get("workers", 1)
    return value if isinstance(value, int) and 0 < value <= 4096 else 1
