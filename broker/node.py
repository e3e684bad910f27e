"""Composition root: builds the broker from its config and runs it.

Startup order: lock the data dir, wipe the scratch dir of transient queues,
load users and vhosts (each vhost replays its definitions log and recovers its
queue stores), import ``[main] load_definitions`` if set, then open the AMQP
listener and the management/metrics HTTP listeners. Shutdown (SIGTERM/SIGINT)
runs in reverse: stop the HTTP listeners, stop accepting AMQP, close every
connection with 320 CONNECTION_FORCED, fsync and close every store, release the lock.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import signal
from collections.abc import Callable
from pathlib import Path

from broker.auth.users import UserStore
from broker.auth.vhosts import VHostStore
from broker.config import Config
from broker.http.definitions import DefinitionsError, import_definitions
from broker.http.server import MgmtServer
from broker.http.state import Mgmt
from broker.metrics import ClusterInfo
from broker.model.vhost import VHost
from broker.net.broker import Broker
from broker.net.server import AMQPServer
from broker.net.syncer import Syncable, Syncer
from broker.store.lock import DataDirLock
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
        self._loop: asyncio.AbstractEventLoop | None = None
        self._syncer: Syncer | None = None

    def make_vhost(self, name: str) -> VHost:
        """A ``VHost`` wired to this node's store settings (at boot, and when the API creates one)."""
        cfg = self.config
        assert self._loop is not None and self._syncer is not None
        return VHost(
            name, cfg.main.data_dir, segment_size=cfg.main.segment_size, sink=self.sink,
            schedule=self._loop.call_soon, mark_dirty=self._syncer.mark_dirty,
            call_later=self._loop.call_later,
            transient_root=cfg.main.data_dir / "transient",
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
        syncer = self._syncer = Syncer(loop, cfg.main.sync, replicated=self.replicated)
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
                                    cfg.main.data_dir / "transient", self.sink)
            mgmt.cluster = self.cluster
            if cfg.main.load_definitions:
                self.load_definitions(Path(cfg.main.load_definitions))
            self.amqp = AMQPServer(broker)
            self.amqp_address = mgmt.amqp_address = await self.amqp.start(cfg.amqp.bind, cfg.amqp.port)
            log.info("AMQP listening on %s:%d (data dir %s, sync %s)", *self.amqp_address,
                     cfg.main.data_dir, "on" if cfg.main.sync else "off")
            if cfg.mgmt.enabled:
                self.http = MgmtServer(mgmt)
                http_addr, metrics_addr = await self.http.start(
                    cfg.mgmt.bind, cfg.mgmt.port, cfg.mgmt.metrics_bind, cfg.mgmt.metrics_port)
                log.info("management HTTP API listening on %s:%d", *http_addr)
                if metrics_addr is not None:
                    log.info("Prometheus metrics listening on %s:%d", *metrics_addr)
        except BaseException:
            self.release_lock()
            raise

    def release_lock(self) -> None:
        lock, self.lock = self.lock, None
        if lock is not None:
            lock.release()

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
        if self.http is not None:
            await self.http.stop()
            self.http = None
        if self.amqp is not None:
            await self.amqp.stop(SHUTDOWN_REASON)
        broker = self.broker
        if broker is None:
            return
        broker.syncer.sync_now()
        for vh in broker.vhosts.values():
            vh.close()
        broker.syncer.shutdown()


class StartupError(Exception):
    """A node cannot start for a reason the operator can fix; the message is one line naming the
    option or path (``skred`` prints it as ``skred: error: ...`` and exits 1)."""


def serve(config: Config) -> int:
    """Run a node until SIGTERM/SIGINT; returns the process exit code."""
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

        return serve_clustered(config)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency except on Windows
        return asyncio.run(Node(config).run())
    return uvloop.run(Node(config).run())
