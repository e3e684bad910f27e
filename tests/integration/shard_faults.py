"""Per-shard leader faults on a real 3-node cluster (``[clustering] shard_leaders``), shared by
``test_cluster_shards.py`` (one trial) and ``benchmarks/chaos.py`` (N trials).

Node ids are fixed (``.node_id`` written before the first start) and the vhost names chosen
by the placement function so that each node is preferred for two of them: with random ids
rendezvous hashing spreads shards only about evenly.

A trial (``kill_and_return``): confirmed publishes to every vhost; on every shard the victim
does not lead a publisher confirms one message at a time, alternately through the cluster
leader and through the surviving follower's proxy; kill -9 of a node that does not hold
``<prefix>/leader`` (the data path is still the cluster leader's, ``broker/shards/leaders.py``);
none of those publishers may wait 1 s or more between two confirms from before the kill until
0.5 s after the failover; its shards must move, and only they, within TTL + 2 s; confirmed
publishes to the moved shards; the node comes back and its shards are handed back; every
confirmed message is counted in its queue.

A drain (``drain_and_return``): SIGTERM to the node holding ``<prefix>/leader`` (it leads shards
of its own too) while a client publishes to one of its shards through it; its shards must be
led by other nodes, each one resigned by the drained node (its guarded delete in etcd, logged
once done) rather than left to its lease, with an ``on_leader_lost`` hook per shard; the client
reconnects to another node and goes on confirming; the node comes back and takes its shards
again; every confirmed message is there. The wait for the shards to move fails on a stall (no
shard resigned or led elsewhere for ``DRAIN_STALL`` seconds), not on a deadline for the whole
move, which a loaded machine misses; the time it took is measured (``moved_in``).
"""

from __future__ import annotations

import base64
import json
import os
import random
import re
import shutil
import signal
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pika

from broker.shards.placement import node_of, vhost_shard

from ._support import count_at
from .test_cluster import Cluster, ClusterNode, start_cluster, wait_for

TTL = 2
BOUND = TTL + 2  # seconds from kill -9 to every moved shard led again
IDS = ["node-a", "node-b", "node-c"]
PER_NODE = 2
BATCH = 10  # confirmed messages per vhost and publish round
GAP_RUN = 12.0  # longest the background publisher runs (seconds), bounded in count too
GAP_MAX = 5000
HANDBACK_WAIT = 30.0
DRAIN_STALL = TTL + 10  # seconds without a drained shard resigned or moved that fail a drain
RESIGNED = re.compile(r"shard '([^']*)': handed over \(this node is stopping\)")  # leaders.py's drain
WON = re.compile(r"shard '([^']*)': leading \(term")  # leaders.py: a node won a shard's key


def pick_vhosts() -> dict[str, str]:
    """Six vhost names, two preferred by each node: vhost -> node id."""
    nodes = dict.fromkeys(IDS, 1)
    chosen: dict[str, str] = {}
    for i in range(1000):
        name = f"shard{i}"
        owner = node_of(vhost_shard(name), nodes)
        if sum(1 for o in chosen.values() if o == owner) < PER_NODE:
            chosen[name] = owner
        if len(chosen) == PER_NODE * len(IDS):
            return chosen
    raise AssertionError("placement never reached two vhosts per node")


VHOSTS = pick_vhosts()


def expected() -> dict[str, str]:
    """Every shard's leader when all three nodes are up: the six vhosts and the default one."""
    return {**VHOSTS, "/": node_of(vhost_shard("/"), dict.fromkeys(IDS, 1))}


def amqp_url(node: ClusterNode, vhost: str) -> str:
    return f"amqp://guest:guest@{node.ip}:{node.port}/{urllib.parse.quote(vhost, safe='')}"


class ShardCluster:
    """Three nodes with per-shard leaders and the six vhosts created."""

    def __init__(self, tmp: Path, extra: tuple[str, ...] = ()) -> None:
        self.c = Cluster(tmp, ttl=TTL)
        self.by_id: dict[str, ClusterNode] = {}
        try:
            self.hook_file = tmp / "shard-hooks.txt"
            hook = f'echo "$SKRED_ROLE $SKRED_NODE_ID ${{SKRED_SHARD-(cluster)}}" >> {self.hook_file}'
            for node, nid in zip(self.c.nodes, IDS, strict=True):
                # the last of a repeated option wins: these hooks name the shard
                node.argv += ["--clustering-shard-leaders", "--clustering-on-leader-elected", hook,
                              "--clustering-on-leader-lost", hook, *extra]
                node.data_dir.mkdir(parents=True, exist_ok=True)
                (node.data_dir / ".node_id").write_text(nid + "\n")
                self.by_id[nid] = node
            self.leader, _followers = start_cluster(self.c)
            for vhost in VHOSTS:
                self.api(self.leader, "PUT", f"/api/vhosts/{vhost}")
                self.api(self.leader, "PUT", f"/api/permissions/{vhost}/guest",
                         {"configure": ".*", "write": ".*", "read": ".*"})
        except BaseException:
            self.close()
            raise

    def leaders(self) -> dict[str, str]:
        """vhost -> node id, from etcd's shard keys."""
        out = self.c.etcd._ctl("get", f"{self.c.prefix}/shards/", "--prefix")
        lines = out.stdout.decode().splitlines()
        found = {}
        for key, value in zip(lines[0::2], lines[1::2], strict=False):
            if key.endswith("/leader"):  # beside it, the shard's ISR key
                found[urllib.parse.unquote(key.split("/")[-2])] = json.loads(value)["node_id"]
        return found

    def served(self) -> dict[str, str]:
        """vhost -> node id, of the shards whose leader key says its holder serves them."""
        out = self.c.etcd._ctl("get", f"{self.c.prefix}/shards/", "--prefix")
        lines = out.stdout.decode().splitlines()
        found = {}
        for key, value in zip(lines[0::2], lines[1::2], strict=False):
            if key.endswith("/leader") and json.loads(value).get("serves") is True:
                found[urllib.parse.unquote(key.split("/")[-2])] = json.loads(value)["node_id"]
        return found

    def isrs(self) -> dict[str, list[str]]:
        """vhost -> its shard's ISR key."""
        out = self.c.etcd._ctl("get", f"{self.c.prefix}/shards/", "--prefix")
        lines = out.stdout.decode().splitlines()
        return {urllib.parse.unquote(key.split("/")[-2]): list(json.loads(value))
                for key, value in zip(lines[0::2], lines[1::2], strict=False) if key.endswith("/isr")}

    def api(self, node: ClusterNode, method: str, path: str, body: Any = None) -> Any:
        req = urllib.request.Request(f"http://{node.ip}:{node.mgmt_port}{path}", method=method,
                                     data=None if body is None else json.dumps(body).encode())
        req.add_header("Authorization", "Basic " + base64.b64encode(b"guest:guest").decode())
        req.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(req, timeout=10) as resp:
            raw = resp.read()
        return json.loads(raw) if raw else None

    def hook_lines(self) -> list[str]:
        try:
            return self.hook_file.read_text().splitlines()
        except FileNotFoundError:
            return []

    def close(self) -> None:
        self.c.close()

    def keep_logs(self, into: Path, why: str) -> Path:
        """Copy every node's log, etcd's and the hooks file, with the shard keys as etcd holds
        them now, into a new directory under ``into`` (the next run writes a directory of its
        own); returns it. For a failed run: a hang shows which hand-over step each node is in
        (``handover.Moves`` logs each shard's step when it changes)."""
        kept = into / f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
        kept.mkdir(parents=True, exist_ok=True)
        for node in self.c.nodes:
            if node.log_path.exists():
                shutil.copy(node.log_path, kept / node.log_path.name)
        for extra in (self.c.etcd.data.parent / "etcd.log", self.hook_file):
            if extra.exists():
                shutil.copy(extra, kept / extra.name)
        keys = ""
        for part in ("leader", "isr", "members/", "shards/"):  # not the clustering secret
            try:
                keys += self.c.etcd._ctl("get", f"{self.c.prefix}/{part}", "--prefix").stdout.decode(
                    errors="replace")
            except Exception as exc:  # etcd itself may be what failed  # noqa: BLE001
                keys += f"reading {part} failed: {exc!r}\n"
        ids = {node.name: nid for nid, node in self.by_id.items()}
        (kept / "etcd-keys.txt").write_text(f"{why}\nnodes: {ids}\n{keys}")
        return kept


def publish(node: ClusterNode, vhost: str, queue: str, count: int) -> int:
    """``count`` persistent messages, each confirmed, to ``queue`` in ``vhost`` through ``node``."""
    with pika.BlockingConnection(pika.URLParameters(amqp_url(node, vhost))) as conn:
        ch = conn.channel()
        ch.confirm_delivery()
        ch.queue_declare(queue, durable=True)
        for i in range(count):
            ch.basic_publish("", queue, f"{vhost}-{i}".encode(), pika.BasicProperties(delivery_mode=2),
                             mandatory=True)
    return count


def queue_depth(node: ClusterNode, vhost: str, queue: str) -> int:
    return count_at(amqp_url(node, vhost), queue)


class GapPublisher(threading.Thread):
    """Confirmed publishes to one vhost through one node, one at a time; records the largest
    gap between confirms. Bounded: GAP_MAX messages or GAP_RUN seconds, or until stopped."""

    def __init__(self, node: ClusterNode, vhost: str, queue: str) -> None:
        super().__init__(daemon=True)
        self.node, self.vhost, self.queue = node, vhost, queue
        self.stop_at = threading.Event()
        self.confirmed = 0
        self.largest_gap = 0.0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with pika.BlockingConnection(pika.URLParameters(amqp_url(self.node, self.vhost))) as conn:
                ch = conn.channel()
                ch.confirm_delivery()
                ch.queue_declare(self.queue, durable=True)
                last = started = time.monotonic()
                while (not self.stop_at.is_set() and self.confirmed < GAP_MAX
                       and time.monotonic() - started < GAP_RUN):
                    ch.basic_publish("", self.queue, b"x", pika.BasicProperties(delivery_mode=2))
                    now = time.monotonic()
                    self.largest_gap = max(self.largest_gap, now - last)
                    last = now
                    self.confirmed += 1
                    time.sleep(0.01)  # a steady trickle, not a flood, on a shared machine
        except BaseException as exc:  # reported by the trial
            self.error = exc


@dataclass
class MoveTrial:
    """What a trial that takes one node's shards away and gives them back measures."""

    victim: str = ""
    moved: list[str] = field(default_factory=list)  # the shards the victim led
    confirmed: int = 0
    lost: int = 0
    handback: float | None = None  # restart to the initial placement again (s)
    notes: list[str] = field(default_factory=list)

    def timed(self, since: float, done: Callable[[], bool], timeout: float, what: str) -> float | None:
        """Seconds from ``since`` until ``done()``; None, with the reason in ``notes``, past ``timeout``."""
        try:
            wait_for(done, timeout, what)
        except AssertionError as exc:
            self.notes.append(str(exc))
            return None
        return time.monotonic() - since

    def moved_away(self, leaders: dict[str, str]) -> list[str]:
        """Of the victim's shards, those another node leads in ``leaders``."""
        return [v for v in self.moved if leaders.get(v) not in (None, self.victim)]

    def led_elsewhere(self, sc: ShardCluster) -> bool:
        return len(self.moved_away(sc.leaders())) == len(self.moved)

    def tally(self, node: ClusterNode, queue: str, expect: dict[str, int],
              live: list[tuple[str, str, int]]) -> None:
        """Confirmed and lost: ``expect`` messages per vhost in ``queue``, and each ``live``
        (vhost, queue, confirmed) of a publisher that ran across the fault, read on ``node``."""
        self.confirmed = sum(expect.values()) + sum(n for _, _, n in live)
        for name, n in expect.items():
            self.lost += max(0, n - queue_depth(node, name, queue))
        for vhost, live_queue, live_confirmed in live:
            self.lost += max(0, live_confirmed - queue_depth(node, vhost, live_queue))


def placed(sc: ShardCluster) -> dict[str, str]:
    """The initial placement, once the cluster has it (every trial starts and ends there)."""
    want = expected()
    wait_for(lambda: sc.leaders() == want, 15, "the initial placement")
    return want


@dataclass
class ShardTrial(MoveTrial):
    failover: float | None = None  # kill -9 to every moved shard led again (s)
    largest_gap: float | None = None  # the largest of ``gaps``
    gaps: dict[str, float] = field(default_factory=dict)  # each other shard's publisher, across the fault (s)


def kill_and_return(sc: ShardCluster, tag: str, rng: random.Random) -> ShardTrial:
    """One trial (see the module's comment); what went wrong is in ``notes``."""
    trial = ShardTrial()
    want = placed(sc)
    data_leader = sc.c.leader()
    assert data_leader is not None
    leader_id = IDS[sc.c.nodes.index(data_leader)]
    trial.victim = rng.choice([n for n in IDS if n != leader_id])
    victim = sc.by_id[trial.victim]
    trial.moved = sorted(v for v, n in want.items() if n == trial.victim)
    queue, gap_queue = f"q-{tag}", f"gap-{tag}"
    expect: dict[str, int] = {}
    for vhost in VHOSTS:
        expect[vhost] = publish(rng.choice(sc.c.nodes), vhost, queue, BATCH)
    survivor = next(sc.by_id[n] for n in IDS if n not in (leader_id, trial.victim))
    others = sorted(v for v, n in VHOSTS.items() if n != trial.victim)
    gaps = [GapPublisher(data_leader if i % 2 == 0 else survivor, v, gap_queue) for i, v in enumerate(others)]
    for gap in gaps:
        gap.start()
    wait_for(lambda: all(g.confirmed >= 20 or g.error for g in gaps), 10, "the gap publishers under way")
    killed = time.monotonic()
    victim.kill9()
    trial.failover = trial.timed(killed, lambda: trial.led_elsewhere(sc), BOUND + 5,
                                 "the victim's shards led by other nodes")
    after = sc.leaders()
    stayed = {v: n for v, n in want.items() if v not in trial.moved}
    if {v: after.get(v) for v in stayed} != stayed:
        trial.notes.append(f"shards the victim did not lead moved: {after} (was {want})")
    time.sleep(0.5)  # the publishers keep running past the failover (the threads measure)
    for gap in gaps:
        gap.stop_at.set()
    for gap in gaps:
        gap.join(30)
        if gap.error is not None:
            trial.notes.append(f"gap publisher on {gap.vhost} via {gap.node.name} failed: {gap.error!r}")
        trial.gaps[f"{gap.vhost} via {gap.node.name}"] = round(gap.largest_gap, 3)
    trial.largest_gap = max(g.largest_gap for g in gaps)
    for vhost in VHOSTS:
        if vhost in trial.moved:  # the moved shards take confirmed publishes meanwhile
            expect[vhost] += publish(data_leader, vhost, queue, BATCH)
    restarted = time.monotonic()
    victim.start()
    early: list[str] = []

    def handed_back() -> bool:
        # whether the victim is in sync is read first (the ISR names it and its first sync is
        # done: its proxy answers), so a shard seen back was handed over after that
        in_sync = (trial.victim in json.loads(sc.c.etcd.get(f"{sc.c.prefix}/isr") or b"[]")
                   and victim.answers())
        now = sc.leaders()
        if not in_sync and any(now.get(v) == trial.victim for v in trial.moved):
            early.append(f"shards handed back before {trial.victim} was in sync: {now}")
        return now == want

    trial.handback = trial.timed(restarted, handed_back, HANDBACK_WAIT,
                                 "the shards handed back to the returning node")
    trial.notes += early[:1]
    wait_for(victim.answers, 20, "the returned node's proxy")
    trial.tally(victim, queue, expect, [(g.vhost, gap_queue, g.confirmed) for g in gaps])
    return trial


class ReconnectingPublisher(threading.Thread):
    """Confirmed publishes to one vhost, first through ``nodes[0]``; when the connection is lost
    it reconnects to the next node (as a client given several addresses does). Counts only
    what was confirmed. Bounded: GAP_MAX messages or GAP_RUN seconds, or until stopped."""

    def __init__(self, nodes: list[ClusterNode], vhost: str, queue: str) -> None:
        super().__init__(daemon=True)
        self.nodes, self.vhost, self.queue = nodes, vhost, queue
        self.stop_at = threading.Event()
        self.confirmed = 0
        self.reconnects = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        started = time.monotonic()
        turn = 0
        while (not self.stop_at.is_set() and self.confirmed < GAP_MAX
               and time.monotonic() - started < GAP_RUN):
            node = self.nodes[turn % len(self.nodes)]
            try:
                with pika.BlockingConnection(pika.URLParameters(amqp_url(node, self.vhost))) as conn:
                    ch = conn.channel()
                    ch.confirm_delivery()
                    ch.queue_declare(self.queue, durable=True)
                    while (not self.stop_at.is_set() and self.confirmed < GAP_MAX
                           and time.monotonic() - started < GAP_RUN):
                        ch.basic_publish("", self.queue, b"x", pika.BasicProperties(delivery_mode=2))
                        self.confirmed += 1
                        time.sleep(0.01)
            except pika.exceptions.AMQPError as exc:  # the node went away: the next one
                self.error = exc
                self.reconnects += 1
                turn += 1
                time.sleep(0.1)
                continue
            self.error = None
            return


@dataclass
class DrainTrial(MoveTrial):
    reconnects: int = 0
    moved_in: float | None = None  # SIGTERM to every drained shard led by another node (s)
    resigned: list[str] = field(default_factory=list)  # the shards the drained node resigned
    exit_code: int | None = None
    # how many times each shard was won by another node between the SIGTERM and the drained
    # node's restart: 1 for each drained shard, 0 for every other (each shard moves once)
    moves: dict[str, int] = field(default_factory=dict)

    def count_moves(self, others: list[ClusterNode], log_from: dict[str, int]) -> None:
        self.moves = {v: 0 for v in expected()}
        for node in others:
            for vhost in WON.findall(node.log_text()[log_from[node.name]:]):
                self.moves[vhost] = self.moves.get(vhost, 0) + 1

    def moved_or_stalled(self, sc: ShardCluster, victim: ClusterNode, log_from: int, since: float) -> None:
        """Wait until every drained shard is led by another node; ``moved_in`` is the time it
        took. A step is a shard the victim logged as resigned or a shard led elsewhere: the wait
        fails (in ``notes``) only when no step came for ``DRAIN_STALL`` seconds."""
        steps, last_step = -1, time.monotonic()
        while True:
            self.read_resigned(victim, log_from)
            now = sc.leaders()
            elsewhere = self.moved_away(now)
            if len(elsewhere) == len(self.moved):
                self.moved_in = time.monotonic() - since
                return
            if len(self.resigned) + len(elsewhere) > steps:
                steps, last_step = len(self.resigned) + len(elsewhere), time.monotonic()
            elif time.monotonic() - last_step > DRAIN_STALL:
                self.notes.append(f"no drained shard resigned or moved for {DRAIN_STALL}s: resigned "
                                  f"{self.resigned}, led {now}")
                return
            time.sleep(0.05)  # poll interval of a wait that fails on a stall

    def read_resigned(self, victim: ClusterNode, log_from: int) -> None:
        """The drained shards the victim's log (from ``log_from``) says it resigned: the line
        comes once its guarded delete of the shard's key succeeded in etcd."""
        self.resigned = sorted(set(RESIGNED.findall(victim.log_text()[log_from:])) & set(self.moved))


def drain_and_return(sc: ShardCluster, tag: str, rng: random.Random) -> DrainTrial:
    """One drain (see the module's comment); what went wrong is in ``notes``."""
    trial = DrainTrial()
    want = placed(sc)
    victim = sc.c.leader()
    assert victim is not None and victim.proc is not None
    trial.victim = IDS[sc.c.nodes.index(victim)]
    trial.moved = sorted(v for v, n in want.items() if n == trial.victim)
    queue, live_queue = f"q-{tag}", f"live-{tag}"
    expect = {vhost: publish(rng.choice(sc.c.nodes), vhost, queue, BATCH) for vhost in VHOSTS}
    target = next(v for v in trial.moved if v in VHOSTS)
    others = [n for n in sc.c.nodes if n is not victim]
    client = ReconnectingPublisher([victim, *others], target, live_queue)
    client.start()
    wait_for(lambda: client.confirmed >= 20 or not client.is_alive(), 10, "the client publishing")
    hooks_before = len(sc.hook_lines())
    log_from = len(victim.log_text())
    others_from = {n.name: len(n.log_text()) for n in others}
    termed = time.monotonic()
    os.kill(victim.proc.pid, signal.SIGTERM)
    trial.moved_or_stalled(sc, victim, log_from, termed)
    try:
        trial.exit_code = victim.proc.wait(30)
    except Exception as exc:  # reported, then the trial goes on with the node killed
        trial.notes.append(f"the drained node did not exit: {exc!r}")
        victim.kill9()
    # the last word once it exited: every shard resigned; the election loop stopped when asked
    trial.read_resigned(victim, log_from)
    if "election loop did not stop" in victim.log_text()[log_from:]:
        trial.notes.append("the drained node's shard election loop outlived its cancel")
    lost_hooks = {f"follower {trial.victim} {v}" for v in trial.moved}
    try:
        wait_for(lambda: lost_hooks <= set(sc.hook_lines()[hooks_before:]), 10,
                 "an on_leader_lost hook per drained shard")
    except AssertionError as exc:
        trial.notes.append(f"{exc}: {sc.hook_lines()[hooks_before:]}")
    after_drain = client.confirmed
    try:
        wait_for(lambda: client.confirmed >= after_drain + 20 or not client.is_alive(), 20,
                 "the client confirming again through another node")
    except AssertionError as exc:
        trial.notes.append(str(exc))
    client.stop_at.set()
    client.join(30)
    if client.error is not None:
        trial.notes.append(f"client failed: {client.error!r}")
    trial.reconnects = client.reconnects
    # moves are counted once both survivors are in every shard's ISR again: a shard that a
    # survivor resigned while it synced from the new cluster leader was won by the other by then
    survivors = sorted(IDS[sc.c.nodes.index(n)] for n in others)
    try:
        wait_for(lambda: all(set(survivors) <= set(isr) for v, isr in sc.isrs().items() if v in want),
                 20, "both survivors in every shard's ISR")
    except AssertionError as exc:
        trial.notes.append(str(exc))
    trial.count_moves(others, others_from)
    restarted = time.monotonic()
    victim.start()
    trial.handback = trial.timed(restarted, lambda: sc.leaders() == want, HANDBACK_WAIT,
                                 "the shards back with the returning node")
    wait_for(victim.answers, 20, "the returned node's AMQP port")
    trial.tally(victim, queue, expect, [(target, live_queue, client.confirmed)])
    return trial
