"""Helpers of the shovel tests: confirmed bulk publishes, counting and draining queues by
message id, an HTTP destination server, and the shovel API.

Bodies are ``<prefix>#<i>|`` (then padding) so a test can tell which messages arrived (duplicates allowed: a
shovel is at-least-once) and which are missing.
"""

from __future__ import annotations

import asyncio
import threading
import urllib.parse
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import aiormq
from aiohttp import web
from pamqp import commands

from ._support import free_port, wait_until
from .test_mgmt_api import Api


def q(name: str) -> str:
    return urllib.parse.quote(name, safe="")


async def _publish(url: str, queue: str, prefix: str, count: int, size: int, declare: dict[str, Any] | None,
                   exchange: str = "") -> None:
    conn = await aiormq.connect(url)
    try:
        ch = await conn.channel()
        if declare is not None:
            await ch.queue_declare(queue, durable=True, arguments=declare)
        props = commands.Basic.Properties(delivery_mode=2, message_id="x")
        pad = b"." * max(0, size - 16)
        for start in range(0, count, 500):  # confirms pipelined, 500 in flight at most
            await asyncio.gather(*(ch.basic_publish(f"{prefix}#{i}|".encode() + pad, exchange=exchange,
                                                    routing_key=queue, properties=props, wait=False)
                                   for i in range(start, min(count, start + 500))))
    finally:
        await conn.close()


def publish(url: str, queue: str, prefix: str, count: int, *, size: int = 0,
            declare: dict[str, Any] | None = None, exchange: str = "") -> None:
    """``count`` persistent messages, every one confirmed (``declare``: declare the queue durable
    with these arguments first)."""
    asyncio.run(asyncio.wait_for(_publish(url, queue, prefix, count, size, declare, exchange), 120))


async def _drain(url: str, queue: str, idle: float) -> list[str]:
    conn = await aiormq.connect(url)
    out: list[str] = []
    try:
        ch = await conn.channel()
        while True:
            try:
                got = await asyncio.wait_for(ch.basic_get(queue, no_ack=True), idle + 5)
            except TimeoutError:
                break
            if got.body is None or got.delivery is None or isinstance(got.delivery, commands.Basic.GetEmpty):
                break
            out.append(got.body.split(b"|", 1)[0].decode())
    finally:
        await conn.close()
    return out


def drain(url: str, queue: str) -> list[str]:
    """Every message id left in the queue, taken out."""
    return asyncio.run(_drain(url, queue, 1.0))


def count(api: Api, vhost: str, queue: str) -> int:
    """Messages in the queue per a passive look through the management API (ready + unacked)."""
    status, body, _ = api.call("GET", f"/api/queues/{q(vhost)}/{q(queue)}")
    if status != 200:
        return -1
    return int(body.get("messages_ready", 0)) + int(body.get("messages_unacknowledged", 0))


def put_shovel(api: Api, vhost: str, name: str, value: dict[str, Any]) -> tuple[int, Any]:
    status, body, _ = api.call("PUT", f"/api/parameters/shovel/{q(vhost)}/{q(name)}", {"value": value})
    return status, body


def shovel_status(api: Api, vhost: str, name: str) -> dict[str, Any] | None:
    for s in api.get(f"/api/shovels/{q(vhost)}"):
        if s["name"] == name:
            return dict(s)
    return None


def wait_state(api: Api, vhost: str, name: str, state: str, timeout: float = 20.0) -> dict[str, Any]:
    found: dict[str, Any] = {}

    def reached() -> bool:
        nonlocal found
        found = shovel_status(api, vhost, name) or {}
        return found.get("state") == state
    wait_until(reached, timeout, f"shovel {name} {state} (last: {found})")
    return found


class HttpSink:
    """An aiohttp server on a thread of its own that answers POSTs with ``statuses`` in turn (then
    200 for ever) and keeps the bodies it answered 2xx, with their headers."""

    def __init__(self, statuses: list[int]) -> None:
        self.statuses = list(statuses)
        self.port = free_port()
        self.accepted: list[bytes] = []
        self.headers: list[dict[str, str]] = []
        self.answered: list[int] = []
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    async def _handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        status = self.statuses.pop(0) if self.statuses else 200
        self.answered.append(status)
        if 200 <= status < 300:
            self.accepted.append(body)
            self.headers.append(dict(request.headers))
        return web.Response(status=status)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_post("/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._runner.cleanup())

    @contextmanager
    def running(self) -> Iterator[HttpSink]:
        self._thread.start()
        self._ready.wait(10)
        try:
            yield self
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)


def ids(prefix: str, n: int) -> set[str]:
    return {f"{prefix}#{i}" for i in range(n)}


def until(pred: Callable[[], bool], timeout: float, what: str) -> None:
    wait_until(pred, timeout, what)
