"""Starts and stops LMQ's listeners (HTTP, MessagePack-RPC) and its StatsD sender.

A port that cannot be bound is logged and that listener stays off while the node runs on: LMQ is
a second front end, and AMQP clients must not lose their broker because, say, 9980 is taken.
Port 0 picks a free port; the bound addresses are kept for the management overview and tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from broker.aio import RequestDeadline
from broker.auth.users import UserStore
from broker.config import LmqConfig
from broker.lmq import http_api, rpc, statsd
from broker.lmq.engine import LMQ
from broker.lmq.limits import BodyGate, Settings

log = logging.getLogger(__name__)


class LMQServer:
    def __init__(self, lmq: LMQ, config: LmqConfig, users: UserStore,
                 peers: Mapping[tuple[str, int], tuple[str, int]] | None = None,
                 gate: BodyGate | None = None, max_bytes_in_flight: int = 256 << 20,
                 reuse_port: bool = False) -> None:
        self.lmq = lmq
        self.reuse_port = reuse_port  # in a worker: beside the parent's hold on the ports (broker/shards)
        self.peers = peers if peers is not None else {}  # tunnel legs -> clients (a cluster leader)
        self.config = config
        self.users = users
        self.gate = gate  # the broker's memory gate (broker/amqp/memory.py), shared with AMQP
        self.max_bytes_in_flight = max_bytes_in_flight
        self.http_address: tuple[str, int] | None = None
        self.rpc_address: tuple[str, int] | None = None
        self._runner: web.AppRunner | None = None
        self._rpc: asyncio.Server | None = None
        self._http: asyncio.Server | None = None
        self._stats: asyncio.Task[None] | None = None
        self._rpc_sessions: set[rpc.Session] = set()  # open MessagePack-RPC connections

    async def start(self) -> None:
        cfg = self.config
        settings = Settings(self.users, cfg.auth, cfg.anonymous_user, self.peers, self.gate,
                            float(cfg.request_timeout), cfg.max_pipelined, self.max_bytes_in_flight)
        app = http_api.build_app(self.lmq, settings)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        try:
            handler: Any = runner.server
            self._http = await asyncio.get_running_loop().create_server(
                lambda: RequestDeadline(handler(), settings.request_timeout), cfg.bind, cfg.http_port,
                reuse_address=True, reuse_port=self.reuse_port or None)
            self._runner = runner
            self.http_address = self._http.sockets[0].getsockname()[:2]
            log.info("LMQ HTTP API on %s:%d", *self.http_address)
        except OSError as exc:
            await runner.cleanup()
            log.error("LMQ HTTP API not started: cannot bind %s:%d: %s", cfg.bind, cfg.http_port,
                      exc.strerror or exc)
        try:
            self._rpc = await asyncio.start_server(
                functools.partial(rpc.serve_connection, self.lmq, settings, self._rpc_sessions),
                cfg.bind, cfg.rpc_port,
                reuse_address=True, reuse_port=self.reuse_port or None)
            self.rpc_address = self._rpc.sockets[0].getsockname()[:2]
            log.info("LMQ MessagePack-RPC on %s:%d", *self.rpc_address)
        except OSError as exc:
            log.error("LMQ MessagePack-RPC not started: cannot bind %s:%d: %s", cfg.bind, cfg.rpc_port,
                      exc.strerror or exc)
        if cfg.stats_interval > 0:
            self._stats = asyncio.get_running_loop().create_task(
                statsd.run(self.lmq, cfg.statsd_host, cfg.statsd_port, cfg.stats_interval / 1000))

    async def stop(self) -> None:
        """Stop listening and end every open connection: LMQ stops with its vhost, on shutdown and
        when the vhost's shard closes here (``Node.close_shard``), and a connection left open would
        go on answering for a vhost this node no longer serves."""
        if self._stats is not None:
            self._stats.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._stats
        if self._rpc is not None:
            self._rpc.close()
        for session in list(self._rpc_sessions):  # a closed server keeps its connections: end them
            session.close()
        if self._http is not None:
            self._http.close()
        if self._runner is not None:
            await self._runner.cleanup()
        self.lmq.close()
