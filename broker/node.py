"""Composition root: builds the broker from its config and runs it.

Startup order: lock the data dir, wipe the scratch dir of transient queues,
load users and vhosts (each vhost replays its definitions log and recovers its
queue stores), import ``[main] load_definitions`` if set, then open the
management/metrics HTTP(S) listeners and the AMQP listeners (AMQP and, with
``[main] tls_cert``, AMQPS). Shutdown (SIGTERM/SIGINT) runs in reverse: stop the HTTP
listeners, stop accepting AMQP, close every connection with 320
CONNECTION_FORCED, fsync and close every store, release the lock. SIGHUP
reloads the TLS certificates (``reload_tls``) without touching connections.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import signal
import ssl
import time
from collections.abc import Callable
from pathlib import Path

from broker import tls
from broker.auth.users import UserStore
from broker.auth.vhosts import VHostStore
from broker.config import Config
from broker.http.definitions import DefinitionsError, import_definitions
from broker.http.server import MgmtServer
from broker.http.state import Mgmt
from broker.lmq.engine import LMQ
from broker.lmq.props import FILE_NAME as LMQ_PROPS_FILE
from broker.lmq.props import PropsStore
from broker.lmq.server import LMQServer
from broker.metrics import ClusterInfo, FollowerMetrics
from broker.model.vhost import VHost
from broker.net import proxy
from broker.net.broker import Broker
from broker.net.listener import Listener, keep_peer
from broker.net.server import AMQPServer
from broker.net.syncer import Syncable, Syncer
from broker.store.fileio import syncfs
from broker.store.jsonstore import read_json, write_json
from broker.store.lock import DataDirLock
from broker.store.segment_log import SegmentFiles
from broker.store.sink import NullSink, ReplicationSink

log = logging.getLogger("skred")

SHUTDOWN_REASON = "broker forced connection closure with reason 'shutdown'"
_NOFILE_CAP = 1 << 20  # soft limit to ask for when the hard limit is "unlimited"


def raise_fd_limit() -> None:
    """Raise the soft RLIMIT_NOFILE to the hard limit (each AMQP connection holds a socket:
    the usual default soft limit of 1024 would cap a node at about a thousand clients)."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, _NOFILE_CAP)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as exc:
        log.warning("could not raise the open files limit from %d to %d: %s", soft, target, exc)
        return
    log.info("raised the open files limit (RLIMIT_NOFILE) from %d to %d", soft, target)


class Node:
    def __init__(self, config: Config, sink: ReplicationSink | None = None) -> None:
        self.config = config
        self.sink: ReplicationSink = sink or NullSink()
        self.stopping = asyncio.Event()
        self.broker: Broker | None = None
        self.amqp: AMQPServer | None = None
        self.amqp_address: tuple[str, int] | None = None
        # Cluster leader: the ISR barrier the Syncer waits for before confirming.
        self.replicated: Callable[[list[Syncable]], asyncio.Future[None]] | None = None
        self.cluster: ClusterInfo | None = None  # cluster member: handed to Mgmt (metrics, /api/cluster)
        self.lock: DataDirLock | None = None
        self.vhost_store: VHostStore | None = None
        self.mgmt: Mgmt | None = None
        self.http: MgmtServer | None = None
        self.http_listeners: list[Listener] = []
        self.tls: tls.ServerTLS | None = None
        self.lmq: LMQServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._syncer: Syncer | None = None
        self._files: SegmentFiles | None = None  # made at load(), after the fd limit was raised

    def make_vhost(self, name: str) -> VHost:
        """A ``VHost`` wired to this node's store settings (at boot, and when the API creates one)."""
        cfg = self.config
        assert self._loop is not None and self._syncer is not None
        return VHost(
            name, cfg.main.data_dir, segment_size=cfg.main.segment_size, sink=self.sink,
            schedule=self._loop.call_soon, mark_dirty=self._syncer.mark_dirty,
            call_later=self._loop.call_later,
            transient_root=cfg.main.data_dir / "transient",
            write_through=cfg.main.ack_sync_interval == 0,
            files=self._files,
        )

    def load(self, loop: asyncio.AbstractEventLoop) -> Broker:
        cfg = self.config
        data_dir = cfg.main.data_dir
        transient_root = data_dir / "transient"
        shutil.rmtree(transient_root, ignore_errors=True)
        transient_root.mkdir(parents=True, exist_ok=True)
        users = UserStore(data_dir / "users.json", self.sink, cfg.main.default_user,
                          cfg.main.default_password)
        vhost_names = self.vhost_store = VHostStore(data_dir / "vhosts.json", self.sink)
        self._files = SegmentFiles()
        syncer = self._syncer = Syncer(loop, cfg.main.sync, replicated=self.replicated,
                                       window=cfg.main.ack_sync_interval / 1000,
                                       bulk_sync=lambda: syncfs(data_dir))
        self._loop = loop
        vhosts: dict[str, VHost] = {}
        for name in vhost_names.list():
            log.info("loading vhost %r", name)
            vhosts[name] = self.make_vhost(name)
            log.info("vhost %r: %d exchanges, %d queues, %d messages", name,
                     len(vhosts[name].exchanges), len(vhosts[name].queues),
                     sum(q.message_count for q in vhosts[name].queues.values()))
        return Broker(cfg, users, vhosts, syncer)

    async def start(self) -> None:
        """Lock the data dir, load the broker, open the listeners (``release_lock`` undoes the lock)."""
        cfg = self.config
        loop = asyncio.get_running_loop()
        raise_fd_limit()
        cfg.main.data_dir.mkdir(parents=True, exist_ok=True)
        lock = self.lock = DataDirLock(cfg.main.data_dir)
        lock.acquire()
        try:
            broker = self.broker = self.load(loop)
            assert self.vhost_store is not None
            mgmt = self.mgmt = Mgmt(broker, self.vhost_store, self.make_vhost, cfg.main.data_dir,
                                    cfg.main.data_dir / "transient")
            mgmt.cluster = self.cluster
            if cfg.clustering.enabled:  # every member reports the same rabbitmq_cluster label
                mgmt.cluster_name = cfg.clustering.etcd_prefix
            if cfg.main.load_definitions:
                self.load_definitions(Path(cfg.main.load_definitions))
            if tls.enabled(cfg.main):
                self.tls = tls.ServerTLS(cfg.main)
            if cfg.lmq.enabled:  # before AMQP: a node that answers AMQP has its LMQ ports open too
                await self.start_lmq(broker)
            # HTTP before AMQP too: once the AMQP port answers, everything answers
            if cfg.mgmt.enabled:
                await self.start_http(broker, mgmt)
            await self.start_amqp(broker, mgmt)
        except BaseException:
            self.release_lock()
            raise

    def tls_context(self) -> ssl.SSLContext:
        """The current server context (read per accepted connection, so a reload applies)."""
        assert self.tls is not None
        return self.tls.context

    def reload_tls(self) -> None:
        """SIGHUP: re-read the TLS certificates; new connections get them, open ones keep theirs."""
        if self.tls is not None:
            self.tls.reload()

    async def start_amqp(self, broker: Broker, mgmt: Mgmt) -> None:
        cfg = self.config
        self.amqp = AMQPServer(broker)
        if cfg.amqp.port >= 0:
            self.amqp_address = mgmt.amqp_address = await self.amqp.start(cfg.amqp.bind, cfg.amqp.port)
            log.info("AMQP listening on %s:%d", *self.amqp_address)
        if self.tls is not None and cfg.amqp.tls_port >= 0:
            mgmt.amqps_address = await self.amqp.start(cfg.amqp.bind, cfg.amqp.tls_port, self.tls_context)
            log.info("AMQPS listening on %s:%d", *mgmt.amqps_address)
        log.info("data dir %s, sync %s", cfg.main.data_dir, "on" if cfg.main.sync else "off")

    async def start_http(self, broker: Broker, mgmt: Mgmt) -> None:
        cfg = self.config
        self.http = MgmtServer(mgmt)
        factory = keep_peer(await self.http.start(cfg.mgmt.metrics_bind, cfg.mgmt.metrics_port))

        def trusted(ip: str) -> bool:
            return proxy.is_trusted(ip, cfg.mgmt.trusted_proxies, broker.trusted_peers)

        if cfg.mgmt.port >= 0:
            listener = Listener("HTTP", factory, trusted)
            self.http_listeners.append(listener)
            mgmt.http_address = await listener.start(cfg.mgmt.bind, cfg.mgmt.port)
            log.info("management HTTP API listening on %s:%d", *mgmt.http_address)
        if self.tls is not None and cfg.mgmt.tls_port >= 0:
            listener = Listener("HTTPS", factory, trusted, tls=self.tls_context)
            self.http_listeners.append(listener)
            mgmt.https_address = await listener.start(cfg.mgmt.bind, cfg.mgmt.tls_port)
            log.info("management HTTPS API listening on %s:%d", *mgmt.https_address)
        if mgmt.metrics_address is not None:
            log.info("Prometheus metrics listening on %s:%d", *mgmt.metrics_address)

    async def start_lmq(self, broker: Broker) -> None:
        """LMQ's front end on the vhost ``[lmq] vhost`` (created when missing), properties in lmq.json."""
        cfg = self.config
        vh = broker.vhosts.get(cfg.lmq.vhost)
        if vh is None:
            assert self.mgmt is not None
            vh = self.mgmt.create_vhost(cfg.lmq.vhost)
        path = cfg.main.data_dir / LMQ_PROPS_FILE
        sink = self.sink
        props = PropsStore(read_json(path, {}), lambda doc: write_json(path, doc, sink))
        self.lmq = LMQServer(LMQ(vh, props, broker.syncer.after_sync), cfg.lmq, broker.users)
        await self.lmq.start()

    def release_lock(self) -> None:
        lock, self.lock = self.lock, None
        if lock is not None:
            lock.release()

    # ------------------------------------------- cluster.host.LeaderBroker (while leading)
    def amqp_port(self) -> int:
        return self.amqp_address[1] if self.amqp_address else 0

    def http_port(self) -> int:
        http = self.mgmt.http_address if self.mgmt is not None else None  # None: plain listener off
        return http[1] if http else 0

    def sync_started(self) -> float | None:
        return None if self.broker is None else self.broker.syncer.sync_started

    def flush_stores(self) -> None:
        if self.broker is not None:
            for vh in self.broker.vhosts.values():
                for q in vh.queues.values():
                    q.store.flush()

    def trust_proxy_headers_from(self, peers: set[str]) -> None:
        assert self.broker is not None, "not started"
        self.broker.trusted_peers = peers

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        try:
            await self.start()
        except DefinitionsError as exc:
            log.error("%s", exc)
            return 1
        try:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.stopping.set)
            loop.add_signal_handler(signal.SIGHUP, self.reload_tls)
            await self.stopping.wait()
            log.info("shutting down")
            await self.shutdown()
        finally:
            self.release_lock()
        log.info("stopped")
        return 0

    def load_definitions(self, path: Path) -> None:
        """Import a RabbitMQ definitions file at boot; raises ``DefinitionsError`` if unusable."""
        assert self.mgmt is not None
        try:
            doc = json.loads(path.read_bytes())
        except (OSError, ValueError) as exc:
            raise DefinitionsError(f"cannot read definitions file {path}: {exc}") from None
        try:
            import_definitions(self.mgmt, doc)
        except DefinitionsError as exc:
            raise DefinitionsError(f"definitions file {path}: {exc}") from None
        log.info("imported definitions from %s", path)

    async def shutdown(self) -> None:
        if self.lmq is not None:
            await self.lmq.stop()
            self.lmq = None
        listeners, self.http_listeners = self.http_listeners, []
        for listener in listeners:
            await listener.stop()
        if self.http is not None:
            await self.http.stop()
            self.http = None
        if self.amqp is not None:
            await self.amqp.stop(SHUTDOWN_REASON)
        broker = self.broker
        if broker is None:
            return
        t0 = time.monotonic()
        broker.syncer.sync_now()
        t1 = time.monotonic()
        if self._files is not None:
            self._files.shutting_down = True  # stores close without trimming (fast)
        for vh in broker.vhosts.values():
            vh.close()
        t2 = time.monotonic()
        broker.syncer.shutdown()
        log.info("stores synced in %.2f s, closed in %.2f s, last background sync waited for %.2f s",
                 t1 - t0, t2 - t1, time.monotonic() - t2)


class NodeHost:
    """The composition root's side of ``broker.cluster.host.Host``: how a cluster member
    builds its leader broker and its follower metrics server."""

    def leader_broker(self, config: Config, sink: ReplicationSink, cluster: ClusterInfo,
                      replicated: Callable[[list[Syncable]], asyncio.Future[None]]) -> Node:
        node = Node(config, sink)
        node.cluster = cluster
        node.replicated = replicated
        return node

    def follower_metrics(self, cluster: ClusterInfo, data_dir: Path, cluster_name: str) -> FollowerMetrics:
        return FollowerMetrics(cluster, data_dir, cluster_name)


def serve(config: Config, host: NodeHost | None = None) -> int:
    """Run a node until SIGTERM/SIGINT; returns the process exit code. ``host`` builds the
    brokers of a cluster member (tests pass one that injects faults)."""
    if config.clustering.enabled:
        from broker.cluster.runner import serve_clustered

        return serve_clustered(config, host or NodeHost())
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency except on Windows
        return asyncio.run(Node(config).run())
    return uvloop.run(Node(config).run())
