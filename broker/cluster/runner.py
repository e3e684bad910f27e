"""A cluster member: follow, campaign, lead, and back again.

Theory of operation
-------------------
Every node runs this same loop (``serve_clustered``). At start it loads or
creates its node id (``<data_dir>/.node_id``), connects to etcd, reads (or
creates, put-if-absent) the cluster secret and takes a lease.

* No leader key: if the ISR key names us (or does not exist yet: a brand-new
  cluster) we campaign; otherwise we wait — only a member of the ISR has every
  confirmed message, so only it may lead. Among ISR members the one with the
  most complete state must win (``standing.py``): a node defers while a live
  ISR member (one with a member record) outranks it — warm over cold, then the
  later term, then a follower over the leader of the same term, which may have
  died with acks in memory only that its followers have on disk (if it led,
  bulk sync would hand its older ack files to everyone and bring acked
  messages back). It defers for at most ``DEFER_LIMIT`` TTLs (a member that
  cannot win for that long is not coming).
* Someone else leads: we follow. ``follower.follow`` bulk-syncs the data dir,
  then applies the action stream, fsyncing before every ack. After the first
  completed sync the client ports (AMQP, HTTP) proxy to the leader. An etcd
  watch on the leader key tells us at once when it changes (deleted on
  resign or lease expiry); the replication connection is then dropped and the
  loop starts over (campaign or follow anew). The key is still read every
  ``WATCH_BACKSTOP`` seconds (every ``POLL`` if the watch cannot be set up or
  dies): a watch stream silently cut by a network fault would otherwise leave
  us following a dead leader forever. The metrics port serves the cluster
  gauges (the host's ``follower_metrics``) while we are not leading.
* We won: stop the proxies, run ``on_leader_elected`` (in the background, it
  must not delay service), hash the data dir into the checksum cache, write
  ISR = [us] fenced on our leadership, boot the broker (``LeaderBroker.start``) from the
  replicated files with the ``LeaderSink`` as its replication sink and the
  sink's ISR barrier in its Syncer, then serve followers on the replication
  port. While leading we watch three things:
  - SIGTERM/SIGINT: stop the broker (stores flush their last bytes to the
    sink), drain replication to the ISR, then resign and revoke the lease, so a
    follower takes over at once with everything;
  - the lease (refresh failing for a TTL, or the leader key no longer ours):
    fence the sink at once (no confirm leaves after that), run
    ``on_leader_lost``, stop the broker, take a new lease and rejoin as a
    follower (a lone ISR member simply campaigns again);
  - the disk: an fsync that has not returned for ``disk_stall_timeout``
    seconds means a zombie leader; fence, revoke the lease and exit(1) so an
    in-sync follower takes over (the stuck fsync thread cannot be joined).
  The watch loop wakes at the lease deadline, and the sink checks the lease
  clock before resolving any barrier, so no confirm leaves after it.

Every node publishes a lease-bound member record (role, and on the leader its
followers' lag) for ``skred --cluster-status``; ``ClusterView`` is the live
status behind the metrics gauges and ``GET /api/cluster``.

The data-dir lock is held by this runner while following and by the leader
broker while leading, so two processes can never write the same data dir.

The runner imports no broker: the composition root hands ``serve_clustered`` a
``Host`` (``broker/cluster/host.py``) that builds the leader broker and the
follower metrics server.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import signal
import socket
import ssl
import time
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from broker import tls
from broker.cluster import codec, follower
from broker.cluster.elsewhere import Elsewhere
from broker.cluster.etcd import CALL_TIMEOUT, Etcd, EtcdError
from broker.cluster.files import NODE_ID_FILE, Scope, shard_name
from broker.cluster.follow_set import FollowSet, Sender, follow_plan, sender_of
from broker.cluster.handover import Moves, Seen, Step
from broker.cluster.hooks import run_hook
from broker.cluster.host import Host, LeaderBroker, ShardElection
from broker.cluster.leader import LeaderSink
from broker.cluster.proxy import Routed, SpliceProxy, Target, Tunnelled
from broker.cluster.shard_server import ShardServer
from broker.cluster.shard_sink import ShardedLeaderSink
from broker.cluster.standing import Standing, load_last_role, save_last_role
from broker.cluster.status import ClusterView
from broker.cluster.vhost_route import Limits
from broker.config import ClusteringConfig, Config, ConfigError, file_mode
from broker.errors import SkredError
from broker.store.lock import DataDirLock

log = logging.getLogger(__name__)

POLL = 0.2  # seconds between looks at the leader key / lease while following or leading
DRAIN_TIMEOUT = 10.0  # graceful leader shutdown: longest wait for the ISR to ack everything
PASSES_STOP = CALL_TIMEOUT + 1.0  # SIGTERM: longest wait for the shard election's pass to end
STATUS_EVERY = 10.0  # seconds between cluster status lines on the leader (debug level: routine)
WATCH_BACKSTOP = 2.0  # seconds between reads of the leader key while its watch is healthy
MEMBER_EVERY = 1.0  # seconds between checks whether our member record in etcd needs rewriting
APPLY_RETRY_FIRST = 1.0  # seconds before syncing again after our disk failed one (doubling)
APPLY_RETRY_MAX = 30.0  # ... at most: a full disk freed is synced again within this
DEFER_LIMIT = 3  # lease TTLs a node waits for a better-placed ISR member to take the lead
_DIRECT = (codec.AMQPS_PORT, codec.HTTPS_PORT)  # proxied to the leader's port, not tunnelled
# a proxy's client port by RabbitMQ's protocol name, as the overview lists a node's listeners
# (LMQ's ports are not listed, as on the cluster leader)
PROTOCOLS = {codec.AMQP_PORT: "amqp", codec.HTTP_PORT: "http", codec.AMQPS_PORT: "amqp/ssl",
             codec.HTTPS_PORT: "https", codec.MQTT_PORT: "mqtt", codec.MQTTS_PORT: "mqtt/ssl",
             codec.STREAM_PORT: "stream", codec.STREAMS_PORT: "stream/ssl"}


def load_node_id(data_dir: Path) -> str:
    path = data_dir / NODE_ID_FILE
    try:
        value = path.read_text().strip()
        if value:
            return value
    except FileNotFoundError:
        pass
    value = secrets.token_hex(8)
    path.write_text(value + "\n")
    return value


def advertised_uri(config: Config) -> str:
    c = config.clustering
    if c.advertised_uri:
        return c.advertised_uri
    host = c.bind if c.bind not in ("0.0.0.0", "::", "") else socket.gethostname()
    return f"tcp://{host}:{c.port}"


def _source_ip(bind: str) -> str | None:
    """Bind outgoing cluster connections to our cluster address, so the leader knows us by it."""
    return None if bind in ("0.0.0.0", "::", "") else bind


class ClusterRunner:
    def __init__(self, config: Config, host: Host) -> None:
        self.config = config
        self.host = host
        self.data_dir = config.main.data_dir
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.node_id = load_node_id(self.data_dir)
        self.uri = advertised_uri(config)
        c = config.clustering
        self.etcd = Etcd(c.etcd_endpoints, c.etcd_prefix, c.lease_ttl)
        self.stopping = asyncio.Event()
        self.secret = b""
        # Where the proxy of each client port (codec.AMQP_PORT ...) splices to: the leader's
        # replication port for the plain ones (tunnels), its own TLS ports for AMQPS and HTTPS.
        self.targets = [Target() for _ in range(codec.WELCOME_PORTS)]
        # per-shard leaders: the AMQP target (a tunnel) of each other node serving shards
        self.shard_targets: dict[Sender, Target] = {}
        self.repl_tls = tls.replication_tls(config.main, c.tls)
        self.node: LeaderBroker | None = None  # the broker, while this node leads (SIGHUP reloads it)
        self.proxies: list[SpliceProxy] = []
        self.listening: list[tuple[str, tuple[str, int]]] = []  # the proxies' ports (PROTOCOLS)
        self.election: ShardElection | None = None  # per-shard leaders (``[clustering] shard_leaders``)
        self.shards_drained: asyncio.Future[None] | None = None  # every shard handed over at a stop
        self.moves = Moves(self.node_id)  # the hand-over of shards between servers (handover.py)
        self.shard_server: ShardServer | None = None  # the shards we serve while following
        self.leader_closed: set[str] = set()  # while leading: the vhosts our broker does not serve
        self.leader_links: FollowSet | None = None  # while leading: the shards served elsewhere, followed
        self.synced_once = False
        self.lock: DataDirLock | None = None
        self.apply_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="skred-replica")
        self._bg: set[asyncio.Task[Any]] = set()
        self.view = ClusterView(self.node_id, self.uri)
        self.view.app = self  # skredctl stop_app/start_app while following (stop_app below)
        self.app_stopped = False
        self.view.last = load_last_role(self.data_dir)
        self.follower_metrics = host.follower_metrics(self.view, self.data_dir, c.etcd_prefix)
        self._metrics_retry_at = 0.0
        self._member_written: tuple[int | None, str] = (None, "")
        self._deferring_since: float | None = None
        self._followed: str | None = None  # the leader last logged as followed
        self._repl_error = ""  # the replication failure last logged
        self._link_errors: dict[Sender, str] = {}  # per-shard links: each one's failure last logged
        self._apply_retry = APPLY_RETRY_FIRST  # next pause after our disk failed a sync

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    def _lock(self) -> None:
        if self.lock is None:
            self.lock = DataDirLock(self.data_dir)
            self.lock.acquire()

    def _unlock(self) -> None:
        lock, self.lock = self.lock, None
        if lock is not None:
            lock.release()

    async def _pause(self, seconds: float) -> None:
        try:
            async with asyncio.timeout(seconds):
                await self.stopping.wait()
        except TimeoutError:
            pass

    # ---------------------------------------------------------------- main loop
    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        loop.add_signal_handler(signal.SIGHUP, self.reload)
        self._lock()
        log.info("cluster node %s (%s) starting, etcd %s prefix %r", self.node_id, self.uri,
                 self.config.clustering.etcd_endpoints, self.etcd.prefix)
        if self.config.clustering.max_unsynced_actions != ClusteringConfig.max_unsynced_actions:
            log.warning("[clustering] max_unsynced_actions is deprecated and has no effect: a follower "
                        "leaves the in-sync set when it stops acking")
        member_loop = asyncio.ensure_future(self._publish_member_loop())
        shards: asyncio.Future[None] | None = None
        drained: asyncio.Future[None] | None = None
        if self.config.clustering.shard_leaders:
            election = self.election = self.host.shard_election(self.config, self.etcd, self.node_id,
                                                                 self.uri, self.view)
            shards = asyncio.ensure_future(election.run())
            drained = self.shards_drained = asyncio.ensure_future(
                self._drain_shards_on_stop(election, shards))
        try:
            while not self.stopping.is_set():
                try:
                    await self._start_follower_metrics()
                    if self.etcd.client is None:
                        await self.etcd.connect()
                        self.secret = await self.etcd.secret()
                    if not self.etcd.lease_alive():
                        await self.etcd.revoke()
                        await self.etcd.grant_lease()
                    code = await self._step()
                    if code is not None:
                        return code
                except EtcdError as exc:
                    self.etcd.outage.failed(exc)
                    await self.etcd.close()
                    await self._pause(1.0)
            return 0
        finally:
            if drained is not None:  # the shards handed over before the lease goes
                if not self.stopping.is_set():
                    self.stopping.set()
                await asyncio.wait([drained], timeout=DRAIN_TIMEOUT)
            await self._stop_shard_server()
            member_loop.cancel()
            await self._stop_proxies()
            await self.follower_metrics.stop()
            await self.etcd.revoke()
            await self.etcd.close()
            self._unlock()
            self.apply_executor.shutdown(wait=True)
            log.info("stopped")

    async def _drain_shards_on_stop(self, election: ShardElection, passes: asyncio.Future[None]) -> None:
        """At SIGTERM/SIGINT, before the broker stops: no more passes, every shard handed over."""
        await self.stopping.wait()
        passes.cancel()
        # a pass ends at its next await; should a cancel ever be lost again (etcd.py, "Cancels"),
        # the drain must not wait for ever: the loop also ends once ``drain`` says we are draining
        _done, pending = await asyncio.wait([passes], timeout=PASSES_STOP)
        if pending:
            log.error("the shard election loop did not stop within %.0fs of its cancel; draining anyway",
                      PASSES_STOP)
        await election.drain()

    async def _start_follower_metrics(self) -> None:
        mgmt = self.config.mgmt
        if not mgmt.enabled or self.follower_metrics.running or time.monotonic() < self._metrics_retry_at:
            return
        try:
            await self.follower_metrics.start(mgmt.metrics_bind, mgmt.metrics_port)
        except OSError as exc:
            self._metrics_retry_at = time.monotonic() + 5.0
            log.error("cannot serve follower metrics on %s:%d: %s", mgmt.metrics_bind, mgmt.metrics_port,
                      exc.strerror or exc)

    async def _publish_member_loop(self) -> None:
        """Keep ``<prefix>/members/<id>`` current (rewritten when the record or our lease changes)."""
        while True:
            # Soon after start (peers rank us by this record before they campaign), then every second.
            await asyncio.sleep(MEMBER_EVERY if self._member_written[0] is not None else POLL)
            lease = self.etcd.lease_id
            if lease is None or self.etcd.client is None:
                continue
            record = json.dumps(self.view.member_record(), sort_keys=True)
            if (lease, record) == self._member_written:
                continue
            try:
                await self.etcd.put_member(self.node_id, json.loads(record))
            except EtcdError as exc:
                log.debug("member record: %s", exc)
                continue
            self._member_written = (lease, record)

    async def _step(self) -> int | None:
        got = await self.etcd.get_leader()
        if got is None:
            self.view.set_role("candidate")
            self._clear_targets()  # no leader: our proxies say so to every client
            isr, isr_raw = await self.etcd.read_isr()
            if isr is None or self.node_id in isr:
                if isr is not None and await self._defer_to_better_member(isr):
                    await self._pause(POLL)
                    return None
                if await self.etcd.campaign(self.uri, isr_raw):
                    return await self._lead()
            else:
                log.info("no leader; not in the ISR %s, waiting", isr)
                await self._pause(POLL * 5)
                return None
            await self._pause(POLL)
            return None
        self._deferring_since = None
        uri, term = got[0].decode(), got[1]
        if uri == self.uri:
            await self.etcd.drop_stale_leader(uri)  # our own key from a previous run: revoke its lease
            await self._pause(POLL)
            return None
        await self._follow(uri, term)
        return None

    def _record_role(self, role: str, term: int) -> None:
        last = {"role": role, "term": term}
        if self.view.last != last:
            save_last_role(self.data_dir, role, term)
            self.view.last = last

    async def _defer_to_better_member(self, isr: list[str]) -> bool:
        """True while a live ISR member with a more complete copy than ours should lead instead."""
        mine = Standing.of(self.view.member_record())
        members = await self.etcd.members()
        better = sorted(m for m, rec in members.items()
                        if m != self.node_id and m in isr and Standing.of(rec) > mine)
        if not mine.warm and self.view.last.get("role") == "leader":
            # We may have died leading: an ISR member not up yet may well have more than we do.
            better += sorted(m for m in isr if m != self.node_id and m not in members)
        if not better:
            return False
        now = time.monotonic()
        if self._deferring_since is None:
            self._deferring_since = now
            log.info("not campaigning: in-sync members %s have a more complete copy, one of them must lead",
                     better)
        if now - self._deferring_since > DEFER_LIMIT * self.etcd.ttl:
            log.warning("in-sync members %s did not take the lead: campaigning", better)
            return False
        return True

    # ---------------------------------------------------------------- follower
    async def _follow(self, uri: str, term: int) -> None:
        parts = urlsplit(uri)
        host, port = parts.hostname or "127.0.0.1", parts.port or 5679
        if uri != self._followed:  # on change only: a dead leader's key is retried every POLL
            self._followed = uri
            self._repl_error = ""
            log.info("following leader %s", uri)
        self.view.set_role("follower", uri)
        self.view.synced = self.synced_once
        loop = asyncio.get_running_loop()

        def on_welcome(w: codec.Welcome) -> None:
            wanted = [(host, port if which in _DIRECT else (port and repl_port))
                      for which, port in enumerate(w.ports)]
            if [(t.host, t.port) for t in self.targets] != wanted:
                self._drop_proxied("the leader changed")  # spliced to a node that no longer leads
            for target, (thost, tport) in zip(self.targets, wanted, strict=True):
                target.host, target.port = thost, tport  # port 0: the leader does not serve it

        def on_synced() -> None:
            self._repl_error = ""  # the link works: the next failure is news again
            self._apply_retry = APPLY_RETRY_FIRST
            self.view.synced = self.view.warm = True
            self._record_role("follower", term)
            if not self.synced_once:
                self.synced_once = True
                self._spawn(self._start_proxies())

        repl_port = port
        task = asyncio.ensure_future(follower.follow(
            host, port, self.data_dir, self.secret, self.node_id, on_welcome, on_synced,
            self.apply_executor, _source_ip(self.config.clustering.bind), self._client_tls())
            if self.election is None else self._follow_shards(uri, on_welcome, on_synced))
        changed = asyncio.Event()
        watch = asyncio.ensure_future(self.etcd.watch("leader", changed.set))
        signalled = asyncio.ensure_future(changed.wait())
        watch_ok = True
        last_read = -WATCH_BACKSTOP  # read the key once right away: it may have moved before the watch
        lost: str | None = None  # why the leader is lost to us, if it is
        try:
            while not task.done() and not self.stopping.is_set():
                await asyncio.wait([task, signalled], timeout=POLL)
                if task.done():
                    break
                if not self.etcd.lease_alive():
                    lost = "our etcd lease expired"
                    break
                now = time.monotonic()
                if watch_ok and watch.done():
                    watch_ok = False
                    error = None if watch.cancelled() else watch.exception()
                    log.warning("leader watch ended (%s): polling the key every %.1fs",
                                error or "stream closed", POLL)
                backstop = WATCH_BACKSTOP if watch_ok else POLL
                if not signalled.done() and now - last_read < backstop:
                    continue
                if signalled.done():
                    changed.clear()
                    signalled = asyncio.ensure_future(changed.wait())
                last_read = now
                try:
                    current = await self.etcd.get("leader")
                except EtcdError as exc:
                    self.etcd.outage.failed(exc)
                    continue
                if current is None or current.decode() != uri:
                    log.info("leader %s is gone", uri)
                    lost = "the leader is gone"
                    self._followed = None  # whoever leads next is news, even the same node
                    break
        finally:
            task.cancel()
            watch.cancel()
            signalled.cancel()
            await asyncio.gather(task, watch, signalled, return_exceptions=True)
            # The single replica worker: wait for any batch still being written.
            await loop.run_in_executor(self.apply_executor, lambda: None)
        error = None if task.cancelled() else task.exception()
        if isinstance(error, follower.LinkSilent):
            lost = "the replication link is silent"
        if lost is not None:
            self._drop_proxied(lost)
            self._clear_targets()  # until a leader welcomes us, clients hear there is none
        if task.cancelled():
            return
        if isinstance(error, follower.AuthRefused):
            log.error("leader %s refused us: %s", uri, error)
            self.secret = await self.etcd.secret()  # re-read: it may have been reset
            await self._pause(1.0)
        elif isinstance(error, follower.ApplyFailed):
            # Our own disk refused the leader's files (full, read-only): each retry is a whole
            # bulk sync for the leader and a hash of our data dir, so back off until one works.
            pause, self._apply_retry = self._apply_retry, min(self._apply_retry * 2, APPLY_RETRY_MAX)
            text = str(error)
            if text != self._repl_error:
                self._repl_error = text
                log.error("replication from %s failed on this node's disk: %s (retrying in %.1fs, "
                          "backing off up to %.0fs)", uri, text, pause, APPLY_RETRY_MAX)
            else:
                log.debug("replication from %s failed again: %s (next try in %.1fs)", uri, text, pause)
            await self._pause(pause)
        elif error is not None:
            text = str(error) or type(error).__name__
            if text != self._repl_error:  # the same failure, retried every POLL: said once
                self._repl_error = text
                log.warning("replication from %s ended: %s", uri, text)
            await self._pause(POLL)

    async def _follow_shards(self, uri: str, on_welcome: Callable[[codec.Welcome], None],
                             on_synced: Callable[[], None]) -> None:
        """Per-shard leaders: follow the cluster leader ``uri`` for the shared files and every
        shard no other node serves, and each node serving shards for those (``follow_set.py``,
        the plan re-read every ``POLL``); returns or raises as the cluster leader's link ends,
        as ``follower.follow`` does."""
        election = self.election
        assert election is not None
        leader = sender_of(uri)
        ended: asyncio.Future[Exception | None] = asyncio.get_running_loop().create_future()

        def welcomed(sender: Sender, w: codec.Welcome) -> None:
            if sender == leader:
                on_welcome(w)
            else:  # a client of a shard it serves is tunnelled to its replication port
                self.shard_targets[sender] = Target(sender.host if w.ports[codec.AMQP_PORT] else None,
                                                   sender.port)

        def end(sender: Sender, error: Exception | None) -> None:
            if sender == leader and not ended.done():
                ended.set_result(error)

        links = FollowSet(self.data_dir, lambda: self.secret, self.node_id, self.apply_executor, welcomed,
                          _source_ip(self.config.clustering.bind), self._client_tls, on_synced, end,
                          self._link_errors, frozenset({leader}))  # the leader's link: ``_follow`` says
        def plan(serving: dict[str, str]) -> dict[Sender, Scope]:
            return follow_plan(self.uri, uri, serving, frozenset(shard_name(v) for v in self.moves.paused),
                               {shard_name(v): s for v, s in self.moves.handing.items()})

        try:
            while not ended.done():
                if not self.config.clustering.shard_servers:
                    await links.set(plan(election.serving()))
                    await asyncio.wait([ended], timeout=POLL)
                    continue
                if not election.ready():  # which node serves what is unknown until a pass read it:
                    await asyncio.wait([ended], timeout=POLL)  # no bulk sync from a stale copy
                    continue
                # one pass's view for both the moves and the plan: a shard whose server's key
                # expired since must be paused before the plan stops naming its server
                seen = election.seen()
                serving = {shard_name(v): s.server for v, s in seen.items() if s.server is not None}

                async def replan(snapshot: dict[str, str] = serving) -> None:  # after the moves' pauses
                    await links.set(plan(snapshot))

                try:
                    await self._move_served_shards(election, seen, uri, replan)
                except (OSError, ValueError, SkredError, EtcdError) as exc:  # retried next POLL
                    log.error("moving the shards we serve: %s", exc)
                await links.set(plan(serving))
                await asyncio.wait([ended], timeout=POLL)
        finally:
            await links.close()
        error = ended.result()
        if error is not None:
            raise error

    async def _move_served_shards(self, election: ShardElection, seen: dict[str, Seen], leader: str,
                                  replan: Callable[[], Awaitable[None]]) -> None:
        """While following: the hand-over (``handover.py``) for the shards this node serves with
        its ``ShardServer``: close those lost (replicated read-only until they are served
        elsewhere), release them once their holder holds their last action, open those won (our
        links drop them first, their last batch written), and say so in their keys."""
        server = self.shard_server
        if server is not None:  # the users and permissions the cluster leader's stream wrote
            server.node.reload_shared()

        def here(vhost: str) -> bool:
            return server is not None and vhost in server.served

        def has_all(vhost: str, holder: str) -> bool:
            return server is not None and holder in server.sink.shard_replicas(shard_name(vhost))

        for vhost, what in self.moves.steps(seen, leader, here, has_all, False):
            if what is Step.CLOSE and server is not None:
                await server.close(vhost, "the shard moved to another node")
                self.moves.closed.add(vhost)
            elif what is Step.RELEASE:
                await self.etcd.release_shard(vhost, seen[vhost].term)  # closed until marked elsewhere
            elif what is Step.OPEN:
                await replan()  # our links no longer write it
                server = await self._shard_server_started()
                if server is not None and (vhost in server.served or await server.open(vhost)):
                    self.moves.closed.discard(vhost)
                    if await election.mark_served(vhost):
                        log.info("shard %r: serving it", vhost)
                    else:
                        log.warning("shard %r: opened, but its key could not be marked served", vhost)
                else:
                    log.warning("shard %r: could not open it (retried next pass)", vhost)
            elif what is Step.SERVE and server is not None and seen[vhost].server != self.uri:
                await election.mark_served(vhost)
        if server is not None:  # served elsewhere now: no longer replicated from here
            for vhost in server.closed - self.moves.closed:
                server.handed(vhost)

    async def _shard_server_started(self) -> ShardServer | None:
        if self.shard_server is not None:
            return self.shard_server
        c = self.config.clustering
        election = self.election

        async def write_isr(vhost: str, members: list[str]) -> bool | None:
            term = election.term_of(vhost) if election is not None else None
            return await self.etcd.write_served_isr(vhost, term, members) if term is not None else False

        server = ShardServer(self.config, self.host, self.node_id, self.secret, self.view, write_isr,
                             self.etcd.lease_alive)
        server.node.advertised = lambda: list(self.listening)  # our proxies: the member's listeners
        try:
            await server.start(c.bind, c.port, self.repl_tls.server if self.repl_tls is not None else None)
        except OSError as exc:
            log.error("cannot serve shards on the replication port %s:%d: %s", c.bind, c.port, exc)
            return None
        self.shard_server = server
        return server

    async def _stop_shard_server(self) -> None:
        server, self.shard_server = self.shard_server, None
        if server is not None:
            self.moves.closed.update(server.served)  # fenced: released to their next holders
            await server.stop()

    async def _start_proxies(self) -> None:
        if self.proxies or self.stopping.is_set() or self.app_stopped:
            return
        cfg = self.config
        source = _source_ip(cfg.clustering.bind)
        wanted = [(codec.AMQP_PORT, "AMQP", cfg.amqp.bind, cfg.amqp.port)]
        if cfg.mgmt.enabled:
            wanted.append((codec.HTTP_PORT, "HTTP", cfg.mgmt.bind, cfg.mgmt.port))
        if tls.enabled(cfg.main):
            wanted.append((codec.AMQPS_PORT, "AMQPS", cfg.amqp.bind, cfg.amqp.tls_port))
            if cfg.mgmt.enabled:
                wanted.append((codec.HTTPS_PORT, "HTTPS", cfg.mgmt.bind, cfg.mgmt.tls_port))
        if cfg.lmq.enabled:  # port 0 ("any free port") names no port clients would know
            if cfg.lmq.http_port:
                wanted.append((codec.LMQ_HTTP_PORT, "LMQ HTTP", cfg.lmq.bind, cfg.lmq.http_port))
            if cfg.lmq.rpc_port:
                wanted.append((codec.LMQ_RPC_PORT, "LMQ RPC", cfg.lmq.bind, cfg.lmq.rpc_port))
        if cfg.mqtt.enabled and cfg.mqtt.port:
            wanted.append((codec.MQTT_PORT, "MQTT", cfg.mqtt.bind, cfg.mqtt.port))
        if cfg.stream.enabled and cfg.stream.port:
            wanted.append((codec.STREAM_PORT, "stream", cfg.stream.bind, cfg.stream.port))
        if cfg.mqtt.enabled and cfg.mqtt.tls_port and tls.enabled(cfg.main):
            wanted.append((codec.MQTTS_PORT, "MQTTS", cfg.mqtt.bind, cfg.mqtt.tls_port))
        if cfg.stream.enabled and cfg.stream.tls_port and tls.enabled(cfg.main):
            wanted.append((codec.STREAMS_PORT, "stream TLS", cfg.stream.bind, cfg.stream.tls_port))
        # Unix sockets: this node's own paths, tunnelled to the leader's port of their protocol
        unix = [(codec.AMQP_PORT, "AMQP", cfg.amqp.unix_path),
                (codec.HTTP_PORT, "HTTP", cfg.mgmt.unix_path if cfg.mgmt.enabled else ""),
                (codec.MQTT_PORT, "MQTT", cfg.mqtt.unix_path if cfg.mqtt.enabled else "")]
        # The Unix sockets first and the AMQP port last, as on a leader (``node.start``): once
        # a follower's AMQP port answers, every other port of it does (clients and tests wait
        # on the AMQP port, then use the others at once)
        for which, name, path in unix:
            if not path:
                continue
            p = SpliceProxy(f"{name} (Unix socket)", self.targets[which], False, source,
                            self._tunnelled(which))
            try:
                await p.start_unix(path, file_mode(cfg.main.unix_mode))
            except (OSError, ValueError) as exc:
                log.error("%s proxy cannot listen on %s: %s", name, path, exc)
                continue
            self.proxies.append(p)
        for which, name, bind, port in wanted[1:] + wanted[:1]:  # AMQP (wanted[0]) last
            if port < 0:
                continue  # that listener is turned off
            if which in _DIRECT:
                # TLS end to end; the PROXY header goes in clear before the client's TLS bytes
                p = SpliceProxy(name, self.targets[which], True, source)
            else:
                p = SpliceProxy(name, self.targets[which], False, source, self._tunnelled(which),
                                self._routed() if which == codec.AMQP_PORT else None)
            try:
                bound = await p.start(bind, port)
            except OSError as exc:
                log.error("%s proxy cannot listen on %s:%d: %s", name, bind, port, exc)
                continue
            self.proxies.append(p)
            if which in PROTOCOLS:
                self.listening.append((PROTOCOLS[which], (bind, bound)))

    def _routed(self) -> Routed | None:
        """With per-shard leaders, AMQP is read up to connection.open and carried to the node
        serving its vhost (``cluster/vhost_route.py``): the cluster leader for every vhost until
        a shard's leader serves it (the per-shard data path, docs/architecture.md)."""
        if not self.config.clustering.shard_leaders:
            return None
        a = self.config.amqp
        leader = self.targets[codec.AMQP_PORT]
        election = self.election

        def serving(vhost: str) -> Target:
            server = self.shard_server
            if server is not None and vhost in server.served:  # ours, before the next pass says so
                me = sender_of(self.uri)
                return Target(me.host, me.port)
            uri = election.serving().get(shard_name(vhost)) if election is not None else None
            if uri is None:
                return leader  # the cluster leader serves it
            if uri == self.uri:
                me = sender_of(uri)
                return Target(me.host, me.port)  # our own broker, through our replication port
            target = self.shard_targets.get(sender_of(uri))
            return target if target is not None and target.host is not None else leader

        return Routed(Limits(a.channel_max, a.frame_max, a.heartbeat), self.host.amqp_server_properties(),
                      serving=serving, login=lambda: leader)

    def _tunnelled(self, which: int) -> Tunnelled:
        return Tunnelled(which, lambda: self.secret, self._client_tls, self.node_id,
                         self.config.clustering.tunnel_keepalive)

    def _clear_targets(self) -> None:
        for t in self.targets:
            t.host, t.port = None, 0

    def _drop_proxied(self, why: str) -> None:
        dropped = sum(p.drop_clients() for p in self.proxies)
        if dropped:
            log.warning("closed %d proxied client connections: %s", dropped, why)

    async def _stop_proxies(self) -> None:
        self.listening = []
        proxies, self.proxies = self.proxies, []
        for p in proxies:
            await p.stop()
        self.synced_once = False

    # ------------------------------------------ skredctl stop_app / start_app while following
    # A follower's app is its proxies of the client ports: stop_app closes them (and every
    # client spliced through them) and keeps following, in sync and in the ISR, a member as
    # RabbitMQ's stopped node stays one; start_app opens them again once synced. The follower's
    # metrics port takes the request (its HTTP port is the leader's). A follower elected
    # leader serves with its app running (the leader's own stop_app is the broker's: node.py).
    @property
    def app_running(self) -> bool:
        return not self.app_stopped

    async def stop_app(self) -> None:
        if not self.app_stopped:
            self.app_stopped = True
            log.info("stop_app: closing the client port proxies; following on")
            await self._stop_proxies()

    async def start_app(self) -> None:
        if self.app_stopped:
            self.app_stopped = False
            log.info("start_app: opening the client port proxies")
            if self.view.synced and self.node is None:
                self.synced_once = True
                await self._start_proxies()

    # ---------------------------------------------------------------- leader
    async def _write_isr(self, members: list[str]) -> bool | None:
        """The ISR, and with per-shard leaders each shard's beside it (the cluster's members less
        those behind on the shard: ``ShardedLeaderSink``) in the same transaction."""
        if self.election is None:
            return await self.etcd.write_isr(members)
        sink = self.view.sink if isinstance(self.view.sink, ShardedLeaderSink) else None
        return await self.etcd.write_isr(members, {
            v: sink.shard_members(shard_name(v), members) if sink is not None else members
            for v in self.election.replicated()})  # a shard served elsewhere: its server's key

    async def _write_shard_isr(self, shard: str, members: list[str]) -> bool | None:
        """One shard's ISR (``ShardedLeaderSink``: a member fell behind on it or caught up)."""
        vhosts = self.election.replicated() if self.election is not None else []
        vhost = next((v for v in vhosts if shard_name(v) == shard), None)
        if vhost is None:
            return True  # deleted meanwhile (the election pass deletes its key), or served elsewhere
        return await self.etcd.write_shard_isr(vhost, members)

    async def _lead(self) -> int | None:
        cfg = self.config
        c = cfg.clustering
        started = time.monotonic()
        log.info("elected leader (node %s, %s)", self.node_id, self.uri)
        self._followed = None
        self.app_stopped = False  # the broker starts with its app running
        await self._stop_proxies()
        await self._stop_shard_server()  # our broker serves them from here (and the port is its sink's)
        await self.follower_metrics.stop()  # the broker serves the metrics port while we lead
        self._spawn(run_hook(c.on_leader_elected, self.node_id, self.uri, "leader"))
        sink = ShardedLeaderSink(self.data_dir, self.node_id, self.secret, self._write_isr,
                                 self._write_shard_isr) if c.shard_leaders \
            else LeaderSink(self.data_dir, self.node_id, self.secret, self._write_isr)
        sink.lease_valid = self.etcd.lease_alive
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, sink.index.scan)
        if not await self._write_isr([self.node_id]):
            log.error("could not write the ISR before serving: giving the leadership up")
            await self.etcd.resign()
            return None
        self._record_role("leader", self.etcd.leader_revision)
        self.view.set_role("leader", self.uri, sink)

        def replicated(dirty: list[Any]) -> asyncio.Future[None]:
            # The syncer has flushed the stores this group commit covers (their meta and
            # buffered acks reach the sink only then), each on its own: one that fails
            # fails its own waiters only (broker.syncer). Per-shard leaders: each shard's own
            # ISR and positions (broker.cluster.shard_sink).
            return sink.shard_barrier() if isinstance(sink, ShardedLeaderSink) else sink.barrier()

        node = self.node = self.host.leader_broker(cfg, sink, self.view, replicated)
        if self.election is not None and cfg.clustering.shard_servers:  # not those another node serves
            closed = self.leader_closed = self.election.closed  # their ISR keys are not ours
            closed.clear()
            closed.update(v for v in self.election.vhosts()
                          if self.election.serving().get(shard_name(v), self.uri) != self.uri)
            node.serves = lambda vhost: vhost not in closed
            node.elsewhere = self._elsewhere(closed)
        self._unlock()
        try:
            await node.start()
        except Exception as exc:
            # one line: the errors a start meets (a port in use, an unusable data dir, a bad
            # certificate) name the option or path; anything else is a bug, traced at debug
            known = isinstance(exc, SkredError | ConfigError | OSError)
            log.error("broker failed to start as leader: %s",
                      exc if known else f"{type(exc).__name__}: {exc}")
            log.debug("leader start failure", exc_info=not known)
            sink.fence()
            await self.etcd.resign()
            await self.etcd.revoke()
            return 1
        self.view.warm = True
        node.trust_proxy_headers_from(sink.member_ips)  # followers' proxies send PROXY headers
        sink.flush_stores = node.flush_stores
        sink.merge_acks = node.merge_acks
        sink.client_addresses = node.client_addresses
        sink.proxied_peers = node.proxied_peers
        sink.proxied_tls = node.proxied_tls
        try:
            await sink.start(c.bind, c.port, self.repl_tls.server if self.repl_tls is not None else None)
        except OSError as exc:
            log.error("replication port %s:%d: %s", c.bind, c.port, exc)
            await self._abdicate(node, sink, "cannot listen for followers")
            return 1
        log.info("leading: serving clients %.2fs after election", time.monotonic() - started)
        if self.election is not None and c.shard_servers:
            self.leader_links = FollowSet(self.data_dir, lambda: self.secret, self.node_id,
                                          self.apply_executor, source_ip=_source_ip(c.bind),
                                          tls=self._client_tls)
        try:
            return await self._watch_leadership(node, sink)
        finally:
            links, self.leader_links = self.leader_links, None
            if links is not None:
                await links.close()
            if isinstance(node.elsewhere, Elsewhere):  # the connections it carried go with it
                await node.elsewhere.carrier.stop()

    def _elsewhere(self, closed: set[str]) -> Elsewhere:
        """The cluster leader's broker carries a connection for a vhost another node serves
        there (``cluster/elsewhere.py``), on a tunnel to that node's replication port."""
        election = self.election
        assert election is not None
        none = Target(None, 0)

        def serving(vhost: str) -> Target:
            uri = election.serving().get(shard_name(vhost)) if vhost in closed else None
            if uri is None or uri == self.uri:
                return none  # ours again, or nobody's yet: the client is told 320 and retries
            there = sender_of(uri)
            return Target(there.host, there.port)

        a = self.config.amqp
        carrier = SpliceProxy("vhost served elsewhere", none, False,
                              _source_ip(self.config.clustering.bind), self._tunnelled(codec.AMQP_PORT),
                              Routed(Limits(a.channel_max, a.frame_max, a.heartbeat),
                                     self.host.amqp_server_properties(), serving=serving,
                                     login=lambda: none))
        def members() -> dict[str, Target]:  # every other live member's replication port
            out: dict[str, Target] = {}
            for node_id, record in election.live_members().items():
                uri = record.get("uri")
                if node_id != self.node_id and isinstance(uri, str) and uri != self.uri:
                    there = sender_of(uri)
                    out[node_id] = Target(there.host, there.port)
            return out

        return Elsewhere(lambda vhost: serving(vhost).host is not None, carrier, closed, members)

    async def _watch_leadership(self, node: LeaderBroker, sink: LeaderSink) -> int | None:
        c = self.config.clustering
        last_check = last_status = time.monotonic()
        while True:
            # Wake at the lease deadline at the latest: stepping down must not wait for a poll.
            await self._pause(max(0.01, min(POLL, self.etcd.lease_deadline() - time.monotonic())))
            now = time.monotonic()
            if self.stopping.is_set() or node.stopping.is_set():
                await self._step_down_gracefully(node, sink)
                return 0
            sync_started = node.sync_started()
            if sync_started is not None and now - sync_started > c.disk_stall_timeout:
                log.critical("fsync stalled for %.0fs: giving up the lease", now - sync_started)
                sink.fence()
                await self.etcd.revoke()
                await run_hook(c.on_leader_lost, self.node_id, self.uri, "follower")
                os._exit(1)  # the stuck fsync thread cannot be joined
            lost = not self.etcd.lease_alive()
            if not lost and now - last_check >= 1.0:
                last_check = now
                try:
                    lost = not await self.etcd.still_leader()
                except EtcdError as exc:
                    self.etcd.outage.failed(exc)  # judged by lease_alive() once the TTL is up
            if lost:
                await self._abdicate(node, sink, "lease lost")
                return None
            if now - last_status >= STATUS_EVERY:
                last_status = now
                log.debug("cluster status: %s", sink.status())
            if self.election is not None and self.config.clustering.shard_servers:
                try:
                    await self._move_led_shards(self.election, node, sink)
                except (OSError, ValueError, SkredError, EtcdError) as exc:  # retried next POLL
                    log.error("moving the shards we serve: %s", exc)

    async def _move_led_shards(self, election: ShardElection, node: LeaderBroker, sink: LeaderSink) -> None:
        """While leading: the hand-over (``handover.py``) for the shards our broker serves by
        default (every one nobody else holds): close one another node holds, release it once
        that node holds its last action, open one won back."""
        closed = self.leader_closed
        seen = election.seen()

        def has_all(vhost: str, holder: str) -> bool:
            return holder in sink.shard_replicas(shard_name(vhost))

        for vhost, what in self.moves.steps(seen, self.uri, lambda v: v not in closed, has_all, True):
            if what is Step.CLOSE:
                closed.add(vhost)
                await node.close_shard(vhost, "the shard moved to another node")
                self.moves.closed.add(vhost)
            elif what is Step.RELEASE:
                one = seen.get(vhost)
                if one is not None and await self.etcd.release_shard(vhost, one.term):
                    log.info("shard %r: released to its holder (term %d)", vhost, one.term)
            elif what is Step.OPEN:
                shard = shard_name(vhost)

                async def write(members: list[str], shard: str = shard) -> bool | None:
                    if isinstance(sink, ShardedLeaderSink):
                        members = sink.shard_members(shard, members)
                    return await self._write_shard_isr(shard, members)

                await self._follow_served(seen)  # our links no longer write it, their last batch written
                # its files as our links left them: our followers' bulk syncs compare against
                # these entries, and delete whatever they do not list (``ShardServer.open``)
                await asyncio.get_running_loop().run_in_executor(None, sink.index.scan, shard)
                closed.discard(vhost)  # its ISR key ours again (our sink's), before it serves
                if await sink.isr_written(write) is not True:
                    closed.add(vhost)
                    continue
                if await node.open_shard(vhost) and await election.mark_served(vhost):
                    self.moves.closed.discard(vhost)
        await self._follow_served(seen)

    async def _follow_served(self, seen: dict[str, Seen]) -> None:
        """While leading: follow each shard another node serves from that node, as any other
        node does (``follow_plan`` with us as the cluster leader), so we are in its ISR and a
        failover of it may come to us; none we serve, closed and not released, or paused."""
        links = self.leader_links
        if links is None:
            return
        serving = {shard_name(v): s.server for v, s in seen.items() if s.server is not None}
        await links.set(follow_plan(self.uri, self.uri, serving,
                                    frozenset(shard_name(v) for v in self.moves.paused),
                                    {shard_name(v): s for v, s in self.moves.handing.items()}))

    def reload(self) -> None:
        """SIGHUP: reload the replication link's certificates (the listener's, and the client
        context of our links and tunnels to a leader; new connections get them, established
        ones keep their session), then the host re-reads the configuration. A leader applies
        what a single node does (log level, trusted PROXY sources, definitions file, client TLS
        certificates); a follower applies the log level, and the rest when it leads (the
        broker it then starts reads them). Ports and addresses need a restart."""
        if self.repl_tls is not None:
            self.repl_tls.reload()
        self.host.reload(self.node)

    def _client_tls(self) -> ssl.SSLContext | None:
        return self.repl_tls.client if self.repl_tls is not None else None

    async def _abdicate(self, node: LeaderBroker, sink: LeaderSink, why: str) -> None:
        """Stop leading at once (no confirm after this), then rejoin as a follower."""
        log.error("stepping down: %s", why)
        sink.fence()
        self.view.set_role("candidate")
        self._spawn(run_hook(self.config.clustering.on_leader_lost, self.node_id, self.uri, "follower"))
        await sink.stop()
        await node.shutdown()
        node.release_lock()
        self._lock()
        await self.etcd.revoke()

    async def _step_down_gracefully(self, node: LeaderBroker, sink: LeaderSink) -> None:
        log.info("shutting down: stopping the broker, then draining replication")
        if self.shards_drained is not None:  # the shards first: closing the stores holds the loop
            await asyncio.wait([self.shards_drained], timeout=DRAIN_TIMEOUT)
        await node.shutdown()  # closes every store: their last bytes go through the sink
        if not await sink.drain(DRAIN_TIMEOUT):
            log.warning("replication drain timed out after %.0fs", DRAIN_TIMEOUT)
        sink.fence()
        await self.etcd.resign()
        await self.etcd.revoke()
        await sink.stop()
        node.release_lock()
        self._lock()
        await run_hook(self.config.clustering.on_leader_lost, self.node_id, self.uri, "follower")


def serve_clustered(config: Config, host: Host) -> int:
    """Run a cluster member until SIGTERM/SIGINT; returns the process exit code."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        return asyncio.run(ClusterRunner(config, host).run())
    return int(uvloop.run(ClusterRunner(config, host).run()))
