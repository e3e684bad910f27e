"""Composition root: builds the broker from its config and runs it.

Startup order: lock the data dir, wipe the scratch dir of transient queues,
load users and vhosts (each vhost replays its definitions log and recovers its
queue stores), then open the AMQP listener. Shutdown (SIGTERM/SIGINT) runs in
reverse: stop accepting, close every connection with 320 CONNECTION_FORCED,
fsync and close every store, release the lock.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import signal

from broker.auth.users import UserStore
from broker.auth.vhosts import VHostStore
from broker.config import Config
from broker.model.vhost import VHost
from broker.net.broker import Broker
from broker.net.server import AMQPServer
from broker.net.syncer import Syncer
from broker.store.lock import DataDirLock
from broker.store.sink import NullSink, ReplicationSink

log = logging.getLogger("skred")

SHUTDOWN_REASON = "broker forced connection closure with reason 'shutdown'"


class Node:
    def __init__(self, config: Config, sink: ReplicationSink | None = None) -> None:
        self.config = config
        self.sink: ReplicationSink = sink or NullSink()
        self.stopping = asyncio.Event()
        self.broker: Broker | None = None
        self.amqp: AMQPServer | None = None
        self.amqp_address: tuple[str, int] | None = None

    def load(self, loop: asyncio.AbstractEventLoop) -> Broker:
        cfg = self.config
        data_dir = cfg.main.data_dir
        transient_root = data_dir / "transient"
        shutil.rmtree(transient_root, ignore_errors=True)
        transient_root.mkdir(parents=True, exist_ok=True)
        users = UserStore(data_dir / "users.json", self.sink, cfg.main.default_user,
                          cfg.main.default_password)
        vhost_names = VHostStore(data_dir / "vhosts.json", self.sink)
        syncer = Syncer(loop, cfg.main.sync)
        vhosts: dict[str, VHost] = {}
        for name in vhost_names.list():
            log.info("loading vhost %r", name)
            vhosts[name] = VHost(
                name, data_dir, segment_size=cfg.main.segment_size, sink=self.sink,
                schedule=loop.call_soon, mark_dirty=syncer.mark_dirty, transient_root=transient_root,
            )
            log.info("vhost %r: %d exchanges, %d queues, %d messages", name,
                     len(vhosts[name].exchanges), len(vhosts[name].queues),
                     sum(q.message_count for q in vhosts[name].queues.values()))
        return Broker(cfg, users, vhosts, syncer)

    async def run(self) -> int:
        cfg = self.config
        loop = asyncio.get_running_loop()
        cfg.main.data_dir.mkdir(parents=True, exist_ok=True)
        lock = DataDirLock(cfg.main.data_dir)
        lock.acquire()
        try:
            broker = self.broker = self.load(loop)
            self.amqp = AMQPServer(broker)
            self.amqp_address = await self.amqp.start(cfg.amqp.bind, cfg.amqp.port)
            log.info("AMQP listening on %s:%d (data dir %s, sync %s)", *self.amqp_address,
                     cfg.main.data_dir, "on" if cfg.main.sync else "off")
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.stopping.set)
            await self.stopping.wait()
            log.info("shutting down")
            await self.shutdown()
        finally:
            lock.release()
        log.info("stopped")
        return 0

    async def shutdown(self) -> None:
        if self.amqp is not None:
            await self.amqp.stop(SHUTDOWN_REASON)
        broker = self.broker
        if broker is None:
            return
        broker.syncer.sync_now()
        for vh in broker.vhosts.values():
            vh.close()
        broker.syncer.shutdown()


def serve(config: Config) -> int:
    """Run a node until SIGTERM/SIGINT; returns the process exit code."""
    if config.clustering.enabled:
        from broker.cluster.runner import serve_clustered

        return serve_clustered(config)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency except on Windows
        return asyncio.run(Node(config).run())
    return uvloop.run(Node(config).run())
