"""Composition root: builds the broker from its config and runs it.

Startup order: lock the data dir, wipe the scratch dir of transient queues,
load users and vhosts (each vhost replays its definitions log; a plain durable
queue's store is recovered on first use, the rest at once), import ``[main]
load_definitions`` if set, then open the client listeners MQTT first (its devices
come back in their thousands after a restart; aiohttp, whose import builds TLS
contexts, is imported only now, for LMQ and the management/metrics HTTP(S)
listeners), LMQ, the stream protocol, HTTP, and last AMQP (AMQP and, with
``[main] tls_cert``, AMQPS: once AMQP answers, everything answers), and recover the
stores not used yet in slices between the loop's other work (``read_stores``: boot
reads no queue's directory, which made 50,000 queues take 107 s to start).
Shutdown (SIGTERM/SIGINT) runs in reverse: stop the HTTP listeners, stop accepting
AMQP, close every connection with 320 CONNECTION_FORCED, fsync and close every
store (one never read is left as it is), release the lock.

SIGHUP (``Reloader``) re-reads the configuration from the same sources (ini file,
environment, flags) and applies what can change at runtime: the log level, the
trusted PROXY sources, the definitions file (imported again) and the TLS
certificates (``reload_tls``: new connections get them, open ones keep theirs). It
logs what it reloaded and which changed options
need a restart; a config that no longer loads is logged and the running one kept.
SIGHUP is per process, so one ``Reloader`` per process knows the node currently
serving. In a cluster the runner hands SIGHUP to it too (``NodeHost.reload``): the
leader applies all of the above; a follower applies the log level at once and keeps
the rest (trusted PROXY sources, definitions file) for when it leads, as the broker it
then starts is built from the reloaded config and reads the TLS certificates afresh
(a follower's proxies pass client TLS through: it holds no client certificate). The
runner reloads the replication link's certificates itself; ports and addresses need a
restart on every node.

With ``[main] workers`` above 1 (0: one per core) ``serve`` runs the parent of
``broker/shards/supervisor.py`` instead, which forks the workers: each runs ``run_worker``,
a ``Node`` with a ``WorkerLink`` (only the vhosts the shard map gives it, the node's shared
files, the client ports shared with ``SO_REUSEPORT``, connections handed to the owner of their
vhost, the management API answered for the node: docs/architecture.md, *Workers*).
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import functools
import json
import logging
import os
import shutil
import signal
import ssl
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from broker import errors, metrics, tls
from broker.aio import Router
from broker.amqp import log_exchange
from broker.amqp.broker import Broker, server_properties
from broker.auth.oauth_keys import OAuthKeys, start_oauth
from broker.auth.parameters import FILE_NAME as PARAMETERS_FILE
from broker.auth.parameters import RUNTIME_FILE_NAME, GlobalParameters, RuntimeParameters
from broker.auth.throttle import LoginThrottle
from broker.auth.users import UserStore
from broker.auth.vhosts import VHostStore
from broker.config import Config, ConfigError, MainConfig, file_mode
from broker.errors import ListenError
from broker.federation import supervisor as federation
from broker.http.definitions import IMPORT_INTENT_FILE, DefinitionsError, import_definitions, resume_import
from broker.http.records_budget import RecordsBounds
from broker.http.state import Mgmt
from broker.lmq.engine import LMQ
from broker.lmq.props import FILE_NAME as LMQ_PROPS_FILE
from broker.lmq.props import PropsStore
from broker.metrics import ClusterInfo, FollowerMetrics
from broker.model.vhost import VHost
from broker.mqtt.durable import vhost_of as session_vhost
from broker.mqtt.retained import adopt
from broker.mqtt.retained import vhost_of as retained_vhost
from broker.mqtt.server import MQTTProtocol, MQTTServer
from broker.net import proxy
from broker.net.listener import Listener, keep_peer
from broker.net.server import AMQPProtocol, AMQPServer
from broker.shards import layout
from broker.shards.placement import worker_of
from broker.shards.supervisor import WorkerSpec, serve_workers, worker_count
from broker.shards.worker import SharedFiles, WorkerLink, name_logs
from broker.shovel.local import Local
from broker.shovel.manager import Shovels
from broker.store.blobs import BlobDir
from broker.store.fileio import syncfs
from broker.store.intent import IntentFile
from broker.store.jsonstore import read_json, write_json
from broker.store.lock import DataDirLock
from broker.store.paths import WORKERS_DIR, data_homes, vhost_dir
from broker.store.queue_store import read_ahead
from broker.store.segment import parse_number
from broker.store.segment_log import SegmentFiles
from broker.store.sink import NULL_SINK, NullSink, ReplicationSink
from broker.streamproto.server import StreamServer
from broker.syncer import Syncable, Syncer

# in each vhost's directory (and, in a data dir from before, the node's: moved at start)
RETAINED_DIR = "mqtt-retained"  # MQTT's retained messages (broker/mqtt/retained.py)
MQTT_SESSIONS_DIR = "mqtt-sessions"  # persistent MQTT sessions' QoS 2 ids, wills (broker/mqtt/durable.py)

if TYPE_CHECKING:
    from broker.cluster.etcd import Etcd
    from broker.cluster.host import LeaderBroker, VhostCarrier
    from broker.cluster.status import ClusterView
    from broker.http.server import MgmtServer
    from broker.lmq.server import LMQServer
    from broker.shards.fanout import Fanout
    from broker.shards.leaders import ShardLeaders

log = logging.getLogger("skred")

SHUTDOWN_REASON = "broker forced connection closure with reason 'shutdown'"
_NOFILE_CAP = 1 << 20  # soft limit to ask for when the hard limit is "unlimited"
# read_stores(): deferred queue stores are recovered this many at a time, for at most
# READ_SLICE seconds, then the loop is left to its other work for READ_PAUSE: at most half
# of the loop's time, so clients arriving at a node still reading (a cold store costs up
# to a few ms) are served at once rather than between slices
READ_BATCH = 4
READ_SLICE = 0.01
READ_PAUSE = 0.01


def login_throttle(main: MainConfig) -> LoginThrottle:
    """The failed-login throttle of ``[main] login_throttle_*`` (broker.auth.throttle)."""
    return LoginThrottle(free=main.login_throttle_free, base=main.login_throttle_delay / 1000,
                         max_interval=main.login_throttle_max_delay / 1000,
                         max_wait=main.login_throttle_max_wait / 1000, quiet=main.login_throttle_forget)


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
    def __init__(self, config: Config, sink: ReplicationSink | None = None,
                 worker: WorkerLink | None = None) -> None:
        self.config = config
        # one worker of several (broker/shards): its vhosts, its hand-overs, the shared files
        self.worker = worker
        # users.json, vhosts.json and global parameters: the node's, whichever worker this is
        self.shared_dir = worker.root if worker is not None else config.main.data_dir
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
        self.http_private: tuple[str, int] | None = None  # a worker's own HTTP port (broker/shards)
        self._early: list[tuple[int, dict[str, object]]] = []  # hand-overs before start_amqp
        self._fanouts: list[Fanout] = []  # a worker's management answers for the node
        self.tls: tls.ServerTLS | None = None
        self.lmq: LMQServer | None = None
        self.mqtt: MQTTServer | None = None
        self.oauth: OAuthKeys | None = None  # the issuer's keys, with oauth in [main] auth_backends
        self.federation: federation.Federation | None = None
        self.shovels: Shovels | None = None
        self.stream: StreamServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._syncer: Syncer | None = None
        self._files: SegmentFiles | None = None  # made at load(), after the fd limit was raised
        self._reader: asyncio.Task[None] | None = None  # read_stores()
        self._deferred = 0  # queue stores the boot left unread
        self._read_ahead_stop = threading.Event()  # set when the reader is done or the node stops
        self.log_exchange: log_exchange.LogExchangeHandler | None = None
        self._app_running = True  # skredctl stop_app/start_app (stop_app below)
        self._app_lock = asyncio.Lock()
        # A cluster node serving the shards it leads (``[clustering] shard_leaders``): the vhosts
        # this broker holds (None: every one); ``open_shard``/``close_shard`` change the set.
        self.serves: Callable[[str], bool] | None = None
        # ... and on the cluster leader, a connection for one another node serves goes there
        # (broker/cluster/elsewhere.py); None: every vhost not held here is refused (530)
        self.elsewhere: VhostCarrier | None = None
        self.lock_data_dir = True  # False: the cluster runner holds it (a node serving its shards)
        # a node's shard broker (loopback listeners) is listed as its member (/api/nodes, the
        # overview's listeners): that member's node name and the client listeners its proxies open
        self.named = ""
        self.advertised: Callable[[], list[tuple[str, tuple[str, int]]]] | None = None
        self._shared: SharedFiles | None = None  # what reload_shared last read
        self._blob_dirs: dict[Path, BlobDir] = {}  # each vhost's MQTT files (``_mqtt_files``)

    @property
    def router(self) -> Router | None:
        """Where MQTT and the stream protocol hand a connection for a vhost not served here: the
        worker that owns it, or on a cluster leader the node that serves it (``elsewhere``)."""
        return self.worker if self.worker is not None else self.elsewhere

    def make_vhost(self, name: str) -> VHost:
        """A ``VHost`` wired to this node's store settings (at boot, and when the API creates one)."""
        cfg = self.config
        assert self._loop is not None and self._syncer is not None
        if self.worker is not None and not self.worker.owns(name):  # one owner per vhost's files
            raise ValueError(f"vhost {name!r} belongs to worker {self.worker.owner(name)} of this node")
        if self.serves is not None and not self.serves(name):
            raise ValueError(f"vhost {name!r} is served by another node of the cluster")
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
        users = UserStore(self.shared_dir / "users.json", self.sink, cfg.main.default_user,
                          cfg.main.default_password, throttle=login_throttle(cfg.main))
        vhost_names = self.vhost_store = VHostStore(self.shared_dir / "vhosts.json", self.sink)
        self._files = SegmentFiles()
        syncer = self._syncer = Syncer(loop, cfg.main.sync, replicated=self.replicated,
                                       window=cfg.main.ack_sync_interval / 1000,
                                       bulk_sync=lambda: syncfs(data_dir))
        self._loop = loop
        vhosts: dict[str, VHost] = {}
        for name in vhost_names.list():
            if self.worker is not None and not self.worker.owns(name):
                continue
            if self.serves is not None and not self.serves(name):
                continue
            log.info("loading vhost %r", name)
            vhosts[name] = self.make_vhost(name)
            log.info("vhost %r: %d exchanges, %d queues", name, len(vhosts[name].exchanges),
                     len(vhosts[name].queues))
        self._deferred = len(self._files.deferred)
        # Stores that were closed cleanly and hold messages replaced their "closed cleanly"
        # meta as they opened: one syncfs makes all of those durable before anything is
        # delivered (a store still waiting would fsync its own first).
        t0 = time.monotonic()
        opened = self._files.sync_opened(data_dir)
        if opened:
            log.info("%d queue stores reopened after a clean stop: synced in %.3f s", opened,
                     time.monotonic() - t0)
        broker = Broker(cfg, users, vhosts, syncer)
        broker.shards = self.elsewhere  # a cluster leader's vhosts served by other nodes
        return broker

    async def start(self) -> None:
        """Lock the data dir, load the broker, open the listeners (``release_lock`` undoes the lock)."""
        cfg = self.config
        loop = asyncio.get_running_loop()
        raise_fd_limit()
        # serve() checked it is a writable directory; no probe file here: in a cluster this data
        # dir is being replicated.
        cfg.main.data_dir.mkdir(parents=True, exist_ok=True)
        if self.lock_data_dir:
            lock = self.lock = DataDirLock(cfg.main.data_dir)
            lock.acquire()
        if self.worker is None and (cfg.main.data_dir / WORKERS_DIR).is_dir():
            # this data dir ran several workers: their vhosts come back (broker/shards/layout.py)
            names = VHostStore(cfg.main.data_dir / "vhosts.json", NULL_SINK).list()
            layout.relocate(cfg.main.data_dir, names, 1, worker_files(cfg, 1))
            adopt_mqtt_dirs(cfg.main.data_dir, names, 1)
        if RELOADER is not None:
            RELOADER.node = self
        try:
            broker = self.broker = self.load(loop)
            self.oauth = await start_oauth(cfg, broker.users)
            assert self.vhost_store is not None
            mgmt = self.mgmt = Mgmt(broker, self.vhost_store, self.make_vhost, cfg.main.data_dir,
                                    cfg.main.data_dir / "transient",
                                    GlobalParameters(self.shared_dir / PARAMETERS_FILE, self.sink),
                                    IntentFile(cfg.main.data_dir / IMPORT_INTENT_FILE, self.sink),
                                    RuntimeParameters(cfg.main.data_dir / RUNTIME_FILE_NAME, self.sink))
            assert mgmt.parameters is not None
            federation.register(mgmt.parameters)
            self.start_shovels(broker, mgmt)  # registers its component: before an import resumes
            resume_import(mgmt)  # an import a crash cut off comes back whole, before anything serves
            mgmt.cluster = self.cluster
            mgmt.records = RecordsBounds(cfg.mgmt.records_memory, cfg.mgmt.records_wait,
                                         cfg.mgmt.records_send_timeout)
            mgmt.app = self  # skredctl stop_app (with workers, every worker's: shards/fanout.py)
            mgmt.vhost_deleted.append(lambda name: self.mqtt.close_vhost(name) if self.mqtt else None)
            mgmt.node_name = broker.node_name = metrics.node_name(cfg.main.node_name, cfg.amqp.port)
            mgmt.member_name, mgmt.advertised = self.named, self.advertised
            if cfg.clustering.enabled:  # every member reports the same rabbitmq_cluster label
                mgmt.cluster_name = cfg.clustering.etcd_prefix
            else:  # a lone node's cluster is named after it (RabbitMQ's default)
                mgmt.cluster_name = mgmt.node_name
            if cfg.main.load_definitions:
                self.load_definitions(Path(cfg.main.load_definitions))
            if tls.enabled(cfg.main):
                self.tls = tls.ServerTLS(cfg.main)
                mgmt.tls_certs = [str(cfg.main.tls_cert)]
            worker = self.worker
            if worker is not None:
                await self.start_worker(worker, loop, broker, mgmt)
            # LMQ runs in the worker that owns its vhost, MQTT and the stream protocol in every
            # worker (a connection is handed to its vhost's owner: docs/architecture.md)
            # MQTT first: its devices come back in their thousands after a restart, and it needs
            # none of aiohttp, whose import (TLS contexts built) the HTTP listeners below pay
            if cfg.mqtt.enabled:
                await self.start_mqtt(broker)  # before AMQP: MQTT answers once AMQP does
            if cfg.lmq.enabled and self._lmq_here():
                await self.start_lmq(broker)  # the same: a node answering AMQP has its LMQ ports open
            if cfg.stream.enabled:
                await self.start_stream(broker)  # and the stream protocol
            # HTTP before AMQP too: once the AMQP port answers, everything answers
            if cfg.mgmt.enabled and worker is None:
                if self.elsewhere is not None:  # a cluster leader's vhosts served by other nodes
                    from broker.http.forward import VhostForward
                    forward = VhostForward(self.elsewhere.open_http, self.elsewhere.open_nodes,
                                           self.elsewhere.server_of, self.elsewhere.open_members)
                    mgmt.middlewares.append(forward.middleware)
                    # the metrics port's parts: each serving node's metrics port
                    parts = functools.partial(self.elsewhere.open_nodes, metrics=True)
                    mgmt.metrics_middlewares.append(VhostForward(self.elsewhere.open_http, parts).middleware)
                await self.start_http(broker, mgmt)
            await self.start_amqp(broker, mgmt)
            self.start_federation(broker, mgmt)
            if self.shovels is not None:
                self.shovels.start()
            early, self._early = self._early, []
            for fd, state in early:  # handed over while our listeners were opening
                self.resume_connection(fd, state)
            if cfg.main.log_exchange:  # log lines to amq.rabbitmq.log (broker/amqp/log_exchange.py)
                self.log_exchange = log_exchange.install(broker.vhosts, broker.node_name,
                                                         loop.call_soon_threadsafe)
        except BaseException:
            self.release_lock()
            raise
        self._reader = loop.create_task(self.read_stores())

    async def start_worker(self, worker: WorkerLink, loop: asyncio.AbstractEventLoop, broker: Broker,
                           mgmt: Mgmt) -> None:
        """One worker of several: join the node (broker/shards/worker.py). Its HTTP listeners
        (the node's port, and a private one the other workers ask for this worker's part of an
        answer) open first; the client ports once the parent says every worker is ready."""
        assert self.vhost_store is not None
        broker.shards = worker
        worker.shared.add(broker.users.path, broker.users.reload)
        worker.shared.add(self.vhost_store.path, self.vhost_store.reload)
        worker.shared.add(mgmt.global_parameters.path, mgmt.global_parameters.reload)
        worker.on_handover = self.resume_connection
        worker.on_reloaded = self.shared_reloaded
        worker.on_parent_gone = self.stopping.set
        worker.start(loop)
        if self.config.mgmt.enabled:
            from broker.shards.fanout import Fanout
            self._fanouts = [Fanout(worker), Fanout(worker, "metrics")]
            mgmt.middlewares.append(self._fanouts[0].middleware)
            mgmt.metrics_middlewares.append(self._fanouts[1].middleware)
            await self.start_http(broker, mgmt)
            assert self.http is not None
            metrics_private = await self.http.start_private_metrics()
            await worker.ready(self.http_private, metrics_private)
        else:
            await worker.ready(None, None)

    def resume_connection(self, fd: int, state: dict[str, object]) -> None:
        """A connection another worker of this node accepted for one of our vhosts."""
        amqp, broker, loop = self.amqp, self.broker, self._loop
        if amqp is None or broker is None or loop is None:
            # ready (its vhosts loaded) but the AMQP server not made yet: held until it is
            self._early.append((fd, state))
            return
        protocol = state.get("protocol", "amqp")
        server = self.mqtt if protocol == "mqtt" else self.stream if protocol == "stream" else amqp
        if server is None:
            os.close(fd)  # off here: the accepting worker had it on (cannot be: one config)
            return
        loop.create_task(server.resume(fd, state))

    def shared_reloaded(self, names: list[str]) -> None:
        """Another worker changed shared files: build the vhosts it created that we own."""
        broker, store, worker = self.broker, self.vhost_store, self.worker
        if broker is None or store is None or worker is None or "vhosts.json" not in names:
            return
        for name in store.list():
            if worker.owns(name) and name not in broker.vhosts:
                broker.vhosts[name] = self.make_vhost(name)
                log.info("vhost %r created", name)

    # --------------------------------------------- shards served at runtime (cluster)
    def reload_shared(self) -> list[str]:
        """A cluster node's shard broker: re-read the shared files replication replaced since we
        read them (users and permissions, vhosts, global parameters); their names."""
        broker, store, mgmt = self.broker, self.vhost_store, self.mgmt
        if broker is None or store is None or mgmt is None:
            return []
        shared = self._shared
        if shared is None:
            shared = self._shared = SharedFiles(self.config.main.data_dir)
            shared.add(broker.users.path, broker.users.reload)
            shared.add(store.path, store.reload)
            shared.add(mgmt.global_parameters.path, mgmt.global_parameters.reload)
            shared.known = dict.fromkeys(shared.known)  # the first call re-reads them all
        return shared.refresh()

    # A node leading a shard serves it (docs/architecture.md, "The per-shard data path"): it
    # boots the shard's vhost from the directory replication wrote when it wins the shard,
    # and closes it without deleting anything when it loses it. The close is fenced: the
    # vhost leaves the broker first (no new connection, publish or declare finds it), then
    # its connections are closed with 320 CONNECTION_FORCED, and every other front end's with
    # its protocol's close (MQTT 5 DISCONNECT 0x9C, the stream protocol's Close; LMQ stops),
    # so no confirm (PUBACK, publish confirm, LMQ 200) of this node reaches a client of the
    # shard afterwards (a publish still waiting for its group commit
    # is never confirmed: its publisher sends it again to the shard's next server); only then
    # do its stores write their last bytes (through the sink) and close, fsynced.
    async def open_shard(self, name: str) -> bool:
        """Serve vhost ``name`` from its directory (the replicated list names it); False when
        it is unknown or served already."""
        broker, store = self.broker, self.vhost_store
        if broker is None or store is None or name in broker.vhosts:
            return False
        store.reload()  # the list replication wrote last
        if name not in store.list():
            return False
        vh = self.make_vhost(name)
        broker.vhosts[name] = vh
        if self.mqtt is not None:  # its retained messages and sessions, as replication left them
            self.mqtt.open_vhost(name)
        cfg = self.config
        if cfg.lmq.enabled and cfg.lmq.vhost == name and self.lmq is None and self._app_running:
            await self.start_lmq(broker)  # LMQ's listeners serve its vhost's shard where it is served
        log.info("shard %r served: %d exchanges, %d queues", name, len(vh.exchanges), len(vh.queues))
        return True

    async def close_shard(self, name: str, reason: str = "the shard moved to another node") -> bool:
        """Stop serving vhost ``name``, fenced (above); its files stay. False when not served."""
        broker = self.broker
        vh = broker.vhosts.pop(name, None) if broker is not None else None
        if broker is None or vh is None:
            return False
        closed = 0
        for session in list(broker.connections):
            if session.vhost == name:
                session.close_connection(errors.ConnectionForced(reason))
                session.wakeup()
                closed += 1
        # every other front end's clients of it (MQTT, the stream protocol, over any listener,
        # WebSocket included), before their sessions' state is forgotten and the stores close
        if self.mgmt is not None:
            closed += sum(fe.close_vhost_clients(name, reason) for fe in self.mgmt.front_ends)
        if self.lmq is not None and self.lmq.lmq.vhost is vh:  # LMQ serves this one vhost: it stops
            await self.lmq.stop()
            self.lmq = None
        if self.mqtt is not None:
            self.mqtt.close_vhost(name)
        syncer = broker.syncer
        for q in vh.queues.values():
            syncer.discard(q.store)
        syncer.discard(vh.definitions)
        vh.close()
        await asyncio.to_thread(syncfs, vh.dir)
        log.info("shard %r closed (%d connections): %s", name, closed, reason)
        return True

    async def read_stores(self) -> None:
        """Recover the queue stores the boot deferred (``VHost``: a plain durable queue's
        store is read on first use), a slice at a time between the loop's other work, so
        counters are exact and a corrupt store is reported soon after start."""
        files, broker = self._files, self.broker
        if files is None or broker is None or not self._deferred:
            return
        t0 = time.monotonic()
        left = len(files.deferred)  # what first uses have not read yet
        # A worker thread reads the stores' files ahead, in the order first uses (and the
        # statistics sampler) take them; reads on the loop then find them cached.
        stop = self._read_ahead_stop
        ahead = asyncio.ensure_future(asyncio.to_thread(read_ahead, files.deferred_dirs(), stop))
        try:
            while files.deferred:
                deadline = time.monotonic() + READ_SLICE
                while files.open_deferred(READ_BATCH) and time.monotonic() < deadline:
                    pass
                await asyncio.sleep(READ_PAUSE)
        finally:
            stop.set()
        await ahead
        # The open metas written meanwhile, in one syncfs off the loop (a store that delivers
        # before it is done fsyncs its own first; one opened after it began is not counted).
        await asyncio.to_thread(files.sync_opened, self.config.main.data_dir)
        log.info("%d queue stores recovered after start (%d by first use, the rest in %.2f s): "
                 "%d messages", self._deferred, self._deferred - left, time.monotonic() - t0,
                 sum(q.message_count for vh in broker.vhosts.values() for q in vh.queues.values()))

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
        amqp = self.amqp = AMQPServer(broker)
        amqp.reuse_port = self.worker is not None  # every worker on the node's port (broker/shards)
        mgmt.websocket_protocols["amqp"] = lambda peer: AMQPProtocol(broker, amqp.protocols, peer)
        mgmt.websocket_max_message = cfg.amqp.frame_max + cfg.main.max_message_size
        options = "amqp.bind/amqp.port, --amqp-bind/--amqp-port"
        if cfg.amqp.port >= 0:
            self.amqp_address = mgmt.amqp_address = await listening(
                options, cfg.amqp.bind, cfg.amqp.port, self.amqp.start(cfg.amqp.bind, cfg.amqp.port))
            log.info("AMQP listening on %s:%d", *self.amqp_address)
            if cfg.amqp.port == 0:  # the name tells nodes on one host apart by the port they got
                name = metrics.node_name(cfg.main.node_name, self.amqp_address[1])
                mgmt.node_name = broker.node_name = name
                if not cfg.clustering.enabled:
                    mgmt.cluster_name = mgmt.node_name
        if self.tls is not None and cfg.amqp.tls_port >= 0:
            mgmt.amqps_address = await listening(
                "amqp.bind/amqp.tls_port, --amqp-bind/--amqp-tls-port", cfg.amqp.bind, cfg.amqp.tls_port,
                self.amqp.start(cfg.amqp.bind, cfg.amqp.tls_port, self.tls_context))
            log.info("AMQPS listening on %s:%d", *mgmt.amqps_address)
        if cfg.amqp.unix_path and (self.worker is None or self.worker.index == 0):
            await listening("amqp.unix_path, --amqp-unix-path", cfg.amqp.unix_path, 0,
                            amqp.start_unix(cfg.amqp.unix_path, unix_mode(cfg.main)))
            log.info("AMQP listening on Unix socket %s", cfg.amqp.unix_path)
        log.info("data dir %s, sync %s", cfg.main.data_dir, "on" if cfg.main.sync else "off")

    async def start_http(self, broker: Broker, mgmt: Mgmt) -> None:
        cfg = self.config
        from broker.http.server import MgmtServer
        self.http = MgmtServer(mgmt)
        reuse = self.http.reuse_port = self.worker is not None  # every worker on the node's ports
        factory = keep_peer(await self.http.start(cfg.mgmt.metrics_bind, cfg.mgmt.metrics_port))

        def trusted(ip: str) -> bool:
            return proxy.is_trusted(ip, cfg.mgmt.trusted_proxies, broker.trusted_peers)

        if reuse:  # and a port of its own, for the other workers (broker/shards/fanout.py)
            listener = Listener("HTTP (this worker)", factory, trusted)
            self.http_listeners.append(listener)
            self.http_private = await listener.start("127.0.0.1", 0)
        if cfg.mgmt.port >= 0:
            listener = Listener("HTTP", factory, trusted, remap=broker.proxied_peers, reuse_port=reuse)
            self.http_listeners.append(listener)
            mgmt.http_address = await listening(
                "mgmt.bind/mgmt.port, --mgmt-bind/--mgmt-port", cfg.mgmt.bind, cfg.mgmt.port,
                listener.start(cfg.mgmt.bind, cfg.mgmt.port))
            log.info("management HTTP API listening on %s:%d", *mgmt.http_address)
        if cfg.mgmt.unix_path and (self.worker is None or self.worker.index == 0):
            listener = Listener("HTTP (Unix socket)", factory, trusted)
            self.http_listeners.append(listener)
            await listening("mgmt.unix_path, --mgmt-unix-path", cfg.mgmt.unix_path, 0,
                            listener.start_unix(cfg.mgmt.unix_path, unix_mode(cfg.main)))
            log.info("management HTTP API listening on Unix socket %s", cfg.mgmt.unix_path)
        if self.tls is not None and cfg.mgmt.tls_port >= 0:
            listener = Listener("HTTPS", factory, trusted, tls=self.tls_context, reuse_port=reuse)
            self.http_listeners.append(listener)
            mgmt.https_address = await listening(
                "mgmt.bind/mgmt.tls_port, --mgmt-bind/--mgmt-tls-port", cfg.mgmt.bind, cfg.mgmt.tls_port,
                listener.start(cfg.mgmt.bind, cfg.mgmt.tls_port))
            log.info("management HTTPS API listening on %s:%d", *mgmt.https_address)
        if mgmt.metrics_address is not None:
            log.info("Prometheus metrics listening on %s:%d", *mgmt.metrics_address)

    def _lmq_here(self) -> bool:
        """LMQ's vhost is this broker's: its worker's, and not a shard another node serves
        (``open_shard`` starts LMQ when it opens here; ``start_lmq`` would take the vhost for a
        missing one and create it)."""
        name = self.config.lmq.vhost
        return (self.worker is None or self.worker.owns(name)) and (self.serves is None or self.serves(name))

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
        engine = LMQ(vh, props, broker.syncer.after_sync, cfg.main.max_message_size)
        engine.node_name = lambda: broker.node_name  # firehose copies (known once AMQP listens)
        from broker.lmq.server import LMQServer
        self.lmq = LMQServer(engine, cfg.lmq, broker.users, broker.proxied_peers, broker.alarm.memory,
                             cfg.amqp.max_bytes_in_flight, reuse_port=self.worker is not None)
        await self.lmq.start()

    def start_shovels(self, broker: Broker, mgmt: Mgmt) -> None:
        """Shovels run where the broker runs: a single node or the cluster's leader (broker/shovel)."""
        assert mgmt.parameters is not None
        local = Local(broker.vhosts, broker.users, broker.syncer.after_sync)
        self.shovels = mgmt.shovels = Shovels(mgmt.parameters, local, lambda: mgmt.node_name)

    async def start_mqtt(self, broker: Broker) -> None:
        """MQTT's listeners over the broker's vhosts and users (broker/mqtt)."""
        cfg = self.config
        if not cfg.mqtt.max_packet_size:
            cfg = dataclasses.replace(cfg, mqtt=dataclasses.replace(
                cfg.mqtt, max_packet_size=cfg.main.max_message_size + 64 * 1024))
        assert self._syncer is not None
        retained, sessions = self._mqtt_files(RETAINED_DIR), self._mqtt_files(MQTT_SESSIONS_DIR)
        # a shard broker's node-wide files are the cluster leader's; a worker's, the parent moved
        # before the fork (adopt_mqtt_dirs)
        if self.serves is None and self.worker is None:
            for name, files_of, vhost_of in ((RETAINED_DIR, retained, retained_vhost),
                                             (MQTT_SESSIONS_DIR, sessions, session_vhost)):
                legacy = BlobDir(cfg.main.data_dir / name, self._syncer.mark_dirty, self.sink)
                moved = adopt(legacy, files_of, broker.vhosts.__contains__, vhost_of,
                              lambda: syncfs(cfg.main.data_dir))
                if moved:
                    log.info("%d MQTT files of %s moved into their vhosts' directories", moved, name)
        if self.worker is not None and self.worker.index != 0:
            cfg = dataclasses.replace(cfg, mqtt=dataclasses.replace(cfg.mqtt, unix_path=""))  # worker 0's
        self.mqtt = MQTTServer(cfg.mqtt, broker.vhosts, broker.users, broker.syncer.after_sync, retained,
                               sessions, peers=broker.proxied_peers)
        self.mqtt.router = self.router
        self.mqtt.registry.node_name = lambda: broker.node_name  # firehose copies
        await self.mqtt.start(self.tls_context if self.tls is not None else None, unix_mode(cfg.main))
        assert self.mgmt is not None
        mqtt = self.mqtt
        self.mgmt.websocket_protocols["mqtt"] = lambda _peer: MQTTProtocol(mqtt, websocket=True)
        self.mgmt.front_ends.append(mqtt)  # its connections and counters in the API and metrics
        self.mgmt.websocket_max_message = max(self.mgmt.websocket_max_message, cfg.mqtt.max_packet_size)
        self.mgmt.other_listeners.update(
            {"mqtt/ssl" if name == "mqtts" else name: addr for name, addr in self.mqtt.addresses.items()})

    def _mqtt_files(self, name: str) -> Callable[[str], BlobDir]:
        """A vhost's MQTT files ``name`` (retained messages, sessions' state): a directory inside
        the vhost's own, so they move, replicate and fail over with its shard (broker/mqtt/retained.py);
        one ``BlobDir`` per directory for the node's life."""
        def files_of(vhost: str) -> BlobDir:
            path = vhost_dir(self.config.main.data_dir, vhost) / name
            found = self._blob_dirs.get(path)
            if found is None:
                assert self._syncer is not None
                found = self._blob_dirs[path] = BlobDir(path, self._syncer.mark_dirty, self.sink)
            return found
        return files_of

    def start_federation(self, broker: Broker, mgmt: Mgmt) -> None:
        """Exchange and queue federation links (broker/federation), once the node serves; the
        cluster name goes into the AMQP server properties, as RabbitMQ's, so the links of other
        brokers can tell which cluster a message left (cycle detection)."""
        broker.server_properties()["cluster_name"] = mgmt.cluster_name
        assert mgmt.parameters is not None
        fed = self.federation = federation.Federation(
            broker.vhosts, mgmt.parameters, broker.syncer.after_sync, lambda: mgmt.cluster_name,
            lambda: mgmt.node_name)
        mgmt.federation_links = fed.status
        fed.start()

    async def start_stream(self, broker: Broker) -> None:
        """The RabbitMQ Stream protocol's listeners over the broker's vhosts and users."""
        cfg = self.config
        if self.worker is not None and self.worker.index != 0:
            cfg = dataclasses.replace(cfg, stream=dataclasses.replace(cfg.stream, unix_path=""))  # worker 0's
        self.stream = StreamServer(cfg.stream, broker.vhosts, broker.users, broker.syncer.after_sync,
                                   peers=broker.proxied_peers)
        self.stream.router = self.router
        await self.stream.start(self.tls_context if self.tls is not None else None, unix_mode(cfg.main))
        assert self.mgmt is not None
        self.mgmt.other_listeners.update(self.stream.addresses)
        self.mgmt.front_ends.append(self.stream)  # its connections and counters in the API and metrics

    async def stop_mqtt_and_stream(self) -> None:
        """Close MQTT's and the stream protocol's listeners and connections (shutdown, stop_app)."""
        mgmt = self.mgmt
        if self.mqtt is not None:
            if mgmt is not None and self.mqtt in mgmt.front_ends:
                mgmt.front_ends.remove(self.mqtt)
            await self.mqtt.stop()
            self.mqtt = None
        if self.stream is not None:
            if mgmt is not None and self.stream in mgmt.front_ends:
                mgmt.front_ends.remove(self.stream)
            await self.stream.stop()
            self.stream = None
        if mgmt is not None:
            mgmt.websocket_protocols.pop("mqtt", None)
            mgmt.other_listeners.clear()  # MQTT's and the stream protocol's addresses

    # ------------------------------- skredctl stop_app / start_app (broker/http/routes_app.py)
    # Stopping the app is RabbitMQ's stop_app: every client listener (AMQP, AMQPS, MQTT, MQTTS,
    # the stream protocol, LMQ, the Unix sockets) closes, every client connection is closed with
    # its protocol's close (AMQP 320 CONNECTION_FORCED, MQTT 5 DISCONNECT 0x8B, the stream
    # protocol's Close), and WebSocket upgrades are refused; the management API, the stores and
    # the group commit run on, so every confirmed message is still there when start_app opens
    # the listeners again. In a cluster the node stays a member (and a leader stays the leader,
    # replicating to its followers): only its clients are turned away. The app state is this
    # process's: a restarted node starts with its app running.
    @property
    def app_running(self) -> bool:
        return self._app_running

    async def stop_app(self) -> None:
        async with self._app_lock:
            if not self._app_running:
                return
            self._app_running = False
            log.info("stop_app: closing every client listener and connection")
            await self.close_clients()
            log.info("stop_app: the app is stopped; the management API serves on")

    async def close_clients(self) -> None:
        mgmt = self.mgmt
        if mgmt is not None:
            mgmt.websocket_protocols.pop("amqp", None)
        if self.amqp is not None:
            await self.amqp.stop(SHUTDOWN_REASON)
            self.amqp = None
        self.amqp_address = None
        if mgmt is not None:
            mgmt.amqp_address = mgmt.amqps_address = None
        await self.stop_mqtt_and_stream()
        if self.lmq is not None:
            await self.lmq.stop()
            self.lmq = None

    async def start_app(self) -> None:
        """Open the client listeners again, as the node's start opened them; one that cannot
        open closes the others again (an error answered means the app did not start)."""
        async with self._app_lock:
            if self._app_running:
                return
            broker, mgmt, cfg = self.broker, self.mgmt, self.config
            assert broker is not None and mgmt is not None
            try:
                if cfg.lmq.enabled and self._lmq_here():
                    await self.start_lmq(broker)
                if cfg.mqtt.enabled:
                    await self.start_mqtt(broker)
                if cfg.stream.enabled:
                    await self.start_stream(broker)
                await self.start_amqp(broker, mgmt)
            except BaseException:
                await self.close_clients()
                raise
            self._app_running = True
            log.info("start_app: the app is running")

    def release_lock(self) -> None:
        if RELOADER is not None and RELOADER.node is self:
            RELOADER.node = None
        lock, self.lock = self.lock, None
        if lock is not None:
            lock.release()

    # ------------------------------------------- cluster.host.LeaderBroker (while leading)
    def client_addresses(self) -> dict[str, tuple[str, int]]:
        mgmt, lmq = self.mgmt, self.lmq
        found = {
            "amqp": self.amqp_address,
            "http": mgmt.http_address if mgmt is not None else None,
            "amqps": mgmt.amqps_address if mgmt is not None else None,
            "https": mgmt.https_address if mgmt is not None else None,
            "lmq_http": lmq.http_address if lmq is not None else None,
            "lmq_rpc": lmq.rpc_address if lmq is not None else None,
            "mqtt": self.mqtt.addresses.get("mqtt") if self.mqtt is not None else None,
            "mqtts": self.mqtt.addresses.get("mqtts") if self.mqtt is not None else None,
            "stream": self.stream.addresses.get("stream") if self.stream is not None else None,
            "streams": self.stream.addresses.get("stream/ssl") if self.stream is not None else None,
            "metrics": mgmt.metrics_address if mgmt is not None else None,  # tunnels only
        }
        return {name: (str(a[0]), int(a[1])) for name, a in found.items() if a}

    @property
    def proxied_peers(self) -> dict[tuple[str, int], tuple[str, int]]:
        assert self.broker is not None, "not started"
        return self.broker.proxied_peers

    @property
    def proxied_tls(self) -> dict[tuple[str, int], tls.PeerTLS]:
        assert self.broker is not None, "not started"
        return self.broker.proxied_tls

    def sync_started(self) -> float | None:
        return None if self._syncer is None else self._syncer.sync_started

    def flush_stores(self) -> None:
        """Push every store's buffered acks and meta to the sink (a follower's bulk sync). One
        that cannot is logged and skipped: its own waiters learn it from the group commit,
        and it must not stop the others, nor the bulk sync."""
        if self.broker is not None:
            for vh in self.broker.vhosts.values():
                for q in vh.queues.values():
                    try:
                        q.store.flush()
                    except Exception:
                        log.exception("could not push queue %r in vhost %r to the replicas", q.name, vh.name)

    def merge_acks(self, path: Path, positions: list[int]) -> int:
        num = parse_number(path.name, "acks.")
        if self.broker is None or num is None:
            return 0
        for vh in self.broker.vhosts.values():
            n = vh.merge_acks(path.parent, num, positions)
            if n is not None:
                return n
        return 0

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
            if RELOADER is None:  # without one (Node used directly), SIGHUP reloads TLS only
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
        if self.log_exchange is not None:
            log_exchange.uninstall(self.log_exchange)
            self.log_exchange = None
        self._read_ahead_stop.set()
        if self.shovels is not None:  # first: a shovel's source gives its messages back
            await self.shovels.stop()
        if self.federation is not None:
            await self.federation.stop()
            self.federation = None
        if self.worker is not None:
            self.worker.stop()
        early, self._early = self._early, []
        for fd, _state in early:
            os.close(fd)
        for fanout in self._fanouts:
            await fanout.close()
        if self._reader is not None:
            self._reader.cancel()
            self._reader = None
        await self.stop_mqtt_and_stream()
        if self.oauth is not None:
            await self.oauth.close()
            self.oauth = None
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
        broker, syncer = self.broker, self._syncer
        if broker is None or syncer is None:
            return
        t0 = time.monotonic()
        syncer.sync_now()
        t1 = time.monotonic()
        if self._files is not None:
            self._files.shutting_down = True  # stores close without trimming (fast)
        for vh in broker.vhosts.values():
            vh.close()
        if self._files is not None and syncer.enabled:
            syncfs(self.config.main.data_dir)  # what the stores wrote while closing (not fsynced)
        t2 = time.monotonic()
        syncer.shutdown()
        log.info("stores synced in %.2f s, closed in %.2f s, last background sync waited for %.2f s",
                 t1 - t0, t2 - t1, time.monotonic() - t2)


class NodeHost:
    """The composition root's side of ``broker.cluster.host.Host``: how a cluster member
    builds its leader broker and its follower metrics server."""

    def leader_broker(self, config: Config, sink: ReplicationSink, cluster: ClusterInfo,
                      replicated: Callable[[list[Syncable]], asyncio.Future[None]]) -> Node:
        if RELOADER is not None:  # what SIGHUP reloaded while this node followed applies now
            config = RELOADER.config
        node = Node(config, sink)
        node.cluster = cluster
        node.replicated = replicated
        return node

    config: Config | None = None  # node names of the follower metrics (subclasses may not set it)

    def __init__(self, config: Config | None = None) -> None:
        self.config = config

    def reload(self, leader: LeaderBroker | None) -> None:
        """SIGHUP in a cluster member: the process's ``Reloader`` (log level at once; what a
        leading node applies through ``RELOADER.node``; the rest is read when this node next
        leads, see ``leader_broker``), else the leader's TLS certificates only."""
        if RELOADER is not None:
            RELOADER.reload()
        elif leader is not None:
            leader.reload_tls()

    def follower_metrics(self, cluster: ClusterInfo, data_dir: Path, cluster_name: str) -> FollowerMetrics:
        name = "" if self.config is None else metrics.node_name(self.config.main.node_name,
                                                                 self.config.amqp.port)
        from broker.http import routes_app  # aiohttp: imported when a follower's metrics start

        return FollowerMetrics(cluster, data_dir, cluster_name, name, routes_app.follower_routes(
            lambda: getattr(cluster, "app", None), self.follower_users(data_dir), lambda: name))

    def follower_users(self, data_dir: Path) -> Callable[[], UserStore | None]:
        """The replicated users file, re-read per login (None until the first sync brought it)."""
        main = None if self.config is None else self.config.main
        held: list[UserStore] = []

        def users() -> UserStore | None:
            path = data_dir / "users.json"
            try:
                if not held and path.exists():
                    held.append(UserStore(path, NULL_SINK, throttle=login_throttle(main) if main else None))
                elif held:
                    held[0].reload()
            except (OSError, ValueError) as exc:  # a replace being applied: ask again
                log.warning("follower: cannot read %s: %s", path, exc)
                return None
            return held[0] if held else None
        return users

    def amqp_server_properties(self) -> dict[str, Any]:
        return server_properties()

    def shard_broker(self, config: Config, sink: ReplicationSink, cluster: ClusterInfo,
                     replicated: Callable[[list[Syncable]], asyncio.Future[None]],
                     serves: Callable[[str], bool]) -> Node:
        node = Node(config, sink)  # this config, not the reloaded one: only its shards' listener
        node.cluster = cluster
        node.replicated = replicated
        node.serves = serves
        node.lock_data_dir = False  # the runner's, while this node follows the cluster leader
        if self.config is not None:  # the member's name, not one of its loopback port
            node.named = metrics.node_name(self.config.main.node_name, self.config.amqp.port)
        return node

    def shard_election(self, config: Config, etcd: Etcd, node_id: str, uri: str,
                       view: ClusterView) -> ShardLeaders:
        from broker.shards.leaders import ShardLeaders  # imports the etcd client: clusters only

        return ShardLeaders(config, etcd, node_id, uri, view, worker_count(config))


def worker_files(config: Config, count: int) -> dict[str, int]:
    """The node files one worker keeps (``layout.relocate``): LMQ's properties in the worker of
    ``[lmq] vhost``. MQTT's retained messages and sessions' state live in each vhost's directory,
    which moves with the vhost (``adopt_mqtt_dirs`` empties the directories of older layouts)."""
    return {LMQ_PROPS_FILE: worker_of(config.lmq.vhost, count)}


def adopt_mqtt_dirs(root: Path, vhosts: list[str], count: int) -> None:
    """Move MQTT's retained messages and sessions' state out of the directories older layouts kept
    them in (a node-wide ``mqtt-retained``/``mqtt-sessions`` in the data dir, or in a worker's data
    dir) into the directory of each vhost named, in the worker of ``count`` that owns it
    (broker/mqtt/retained.py ``adopt``: every copy durable before any old file goes; a file of an
    unknown vhost stays). Run, as ``layout.relocate``, before any worker runs, so every worker's
    vhosts have their state at once."""
    def files_of(name: str) -> Callable[[str], BlobDir]:
        return lambda vhost: BlobDir(vhost_dir(layout.worker_dir(root, worker_of(vhost, count), count), vhost)
                                     / name, _unsynced)
    here = set(vhosts).__contains__
    for name, vhost_of in ((RETAINED_DIR, retained_vhost), (MQTT_SESSIONS_DIR, session_vhost)):
        for home in data_homes(root):
            moved = adopt(BlobDir(home / name, _unsynced), files_of(name), here, vhost_of,
                          lambda: syncfs(root))
            if moved:
                log.info("%d MQTT files of %s moved into their vhosts' directories", moved, home / name)


def _unsynced(_files: BlobDir) -> None:
    """No group commit runs before the workers: ``adopt_mqtt_dirs`` syncs the file system itself."""


def run_worker(spec: WorkerSpec) -> int:
    """The body of one worker process of a multi-worker node (forked by broker/shards/supervisor.py)."""
    name_logs(spec.index)
    if RELOADER is not None:  # the fork reset the signals: SIGHUP (passed on by the parent) reloads
        RELOADER.install()
    node = Node(spec.config, worker=WorkerLink(spec.index, spec.count, spec.sock, spec.root))
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency except on Windows
        return asyncio.run(node.run())
    return uvloop.run(node.run())


async def listening(options: str, host: str, port: int, start: Awaitable[tuple[str, int]]) -> tuple[str, int]:
    """The bound address of a listener's ``start``; ``ListenError`` naming ``options`` if it fails."""
    try:
        return await start
    except OSError as exc:
        raise ListenError(options, host, port, exc) from None


def unix_mode(main: MainConfig) -> int:
    """``[main] unix_mode`` as a file mode; ``StartupError`` when it is not octal."""
    try:
        return file_mode(main.unix_mode)
    except ValueError:
        raise StartupError(f"[main] unix_mode / --unix-mode: {main.unix_mode!r} is not an octal file mode") \
            from None


class StartupError(Exception):
    """A node cannot start for a reason the operator can fix; the message is one line naming the
    option or path (``skred`` prints it as ``skred: error: ...`` and exits 1)."""


def check_data_dir(path: Path) -> None:
    """Create the data directory if needed; ``StartupError`` naming it if it is unusable."""
    where = "([main] data_dir / --data-dir)"
    if path.exists() and not path.is_dir():
        raise StartupError(f"data directory {path} {where} is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        why = f"is not writable: {exc.strerror}"
        if exc.errno == errno.EROFS:
            why = "is on a read-only file system"
        elif exc.errno in (errno.EACCES, errno.EPERM):
            why = "is not writable (permission denied)"
        raise StartupError(f"data directory {path} {where} {why}") from None


class Reloader:
    """SIGHUP for this process: re-read the config, apply what can change, log what changed."""

    def __init__(self, config: Config, load: Callable[[], Config]) -> None:
        self.config = config
        self.load = load
        self.node: Node | None = None  # the node serving clients now (set by Node.start)

    def install(self) -> None:
        signal.signal(signal.SIGHUP, self._signalled)

    def _signalled(self, signum: int, frame: FrameType | None) -> None:
        # A Python-level handler runs in the main thread between bytecodes: hand the work to the
        # event loop when one runs (asyncio and uvloop both), else do it right here.
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.reload()
            return
        loop.call_soon(self.reload)

    def reload(self) -> None:
        try:
            new = self.load()
        except (ConfigError, SystemExit) as exc:
            log.error("SIGHUP: configuration not reloaded, keeping the running one: %s", exc)
            return
        old, done = self.config, []
        if new.main.log_level != old.main.log_level:
            logging.getLogger().setLevel(new.main.log_level.upper())
            done.append(f"log level {old.main.log_level} -> {new.main.log_level}")
        node = self.node
        broker = node.broker if node is not None else None
        if broker is not None and new.amqp.trusted_proxies != old.amqp.trusted_proxies:
            amqp = dataclasses.replace(broker.config.amqp, trusted_proxies=new.amqp.trusted_proxies)
            broker.config = dataclasses.replace(broker.config, amqp=amqp)
            done.append(f"trusted proxies: {', '.join(new.amqp.trusted_proxies) or 'none'}")
        if node is not None and new.main.load_definitions:
            try:
                node.load_definitions(Path(new.main.load_definitions))
                done.append(f"definitions from {new.main.load_definitions}")
            except DefinitionsError as exc:
                log.error("SIGHUP: %s", exc)
        if node is not None and node.tls is not None and node.tls.reload():  # it logs a failure itself
            done.append("TLS certificates")
        applied = {"main.log_level", "amqp.trusted_proxies", "main.load_definitions"}
        restart = [f"{section}.{f.name}"
                   for section in ("main", "amqp", "mgmt", "clustering", "lmq", "mqtt", "stream")
                   for f in dataclasses.fields(getattr(new, section))
                   if f"{section}.{f.name}" not in applied
                   and getattr(getattr(new, section), f.name) != getattr(getattr(old, section), f.name)]
        self.config = dataclasses.replace(
            old, main=dataclasses.replace(old.main, log_level=new.main.log_level,
                                          load_definitions=new.main.load_definitions),
            amqp=dataclasses.replace(old.amqp, trusted_proxies=new.amqp.trusted_proxies))
        log.info("SIGHUP: reloaded %s", "; ".join(done) if done else "nothing (no runtime option changed)")
        if restart:
            log.warning("SIGHUP: changed options that need a restart to apply: %s", ", ".join(restart))


# SIGHUP is process-wide state by nature: the one Reloader of this process (set by ``serve``).
RELOADER: Reloader | None = None


# glibc malloc's M_TRIM_THRESHOLD and M_MMAP_THRESHOLD (mallopt parameters -1 and -3)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
HEAP_BLOCKS_UP_TO = 16 << 20  # a block this large or larger gets its own mapping
HEAP_TRIM_OVER = 32 << 20  # free memory at the top of the heap kept for reuse


def keep_buffers_on_the_heap() -> bool:
    """Keep the broker's short-lived large buffers in reused heap memory (glibc only; False
    where there is no ``mallopt``).

    Every socket read (up to 256 KiB), every joined delivery write and every join of a frame
    cut between two reads is a block of 100 KiB or more that lives for one loop turn. By
    default glibc maps such a block on its own or gives the top of the heap back to the
    system once 128 KiB are free there, so each turn starts on fresh pages, one page fault
    per 4 KiB: 1.25 M faults in 8 s of workload (1) in benchmarks/, a third of the
    broker's CPU, and enough to make it fall behind a fast consumer for good. With blocks
    under 16 MiB on the heap and up to 32 MiB of free heap kept, 5 s of it take about 4,500.
    (1 MiB and 4 MiB were not enough: the heap top still went back and forth with scenario
    (a)'s 16-byte deliveries, 28 % slower than with glibc's defaults.)
    """
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_TRIM_THRESHOLD, HEAP_TRIM_OVER) and mallopt(_M_MMAP_THRESHOLD, HEAP_BLOCKS_UP_TO))


def import_listeners() -> None:
    """Import the HTTP listeners' modules (aiohttp). A single process imports them when it opens
    them, after its client ports (a boot with 10,000 MQTT sessions spent a tenth of its CPU on
    aiohttp's import, issue 28); workers share the parent's import."""
    import broker.http.server
    import broker.lmq.server
    import broker.shards.fanout  # noqa: F401


def serve(config: Config, host: NodeHost | None = None, load: Callable[[], Config] | None = None) -> int:
    """Run a node until SIGTERM/SIGINT; returns the process exit code.

    ``host`` builds the brokers of a cluster member (tests pass one that injects faults);
    ``load`` re-reads the configuration from its sources: with it, SIGHUP reloads (``Reloader``)."""
    global RELOADER
    if load is not None:
        RELOADER = Reloader(config, load)
        RELOADER.install()
    check_data_dir(config.main.data_dir)
    # The group-commit worker needs the GIL for a few lines around each fsync; by default the
    # event loop keeps it for up to 5 ms before handing it over, and a publisher waiting for
    # its confirm waits that long too. 0.5 ms bounds that wait.
    sys.setswitchinterval(0.0005)
    keep_buffers_on_the_heap()
    workers = worker_count(config)
    if workers > 1:
        if config.main.load_definitions:
            raise StartupError("[main] load_definitions is not supported with more than one worker yet: "
                               "set [main] workers = 1 (--workers 1)")
        import_listeners()  # once, before the fork, rather than in every worker
        return serve_workers(config, workers, run_worker, worker_files(config, workers), adopt_mqtt_dirs)
    if config.clustering.enabled:
        try:
            from broker.cluster.runner import serve_clustered
        except ImportError as exc:
            if exc.name != "aetcd":
                raise
            raise StartupError(
                "clustering is enabled ([clustering] enabled / --clustering) but the etcd client "
                "'aetcd' is not installed: pip install aetcd"
            ) from None

        return serve_clustered(config, host or NodeHost(config))
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency except on Windows
        return asyncio.run(Node(config).run())
    return uvloop.run(Node(config).run())
