"""A worker's side of a multi-worker node: the shard map, hand-over, shared state.

Theory of operation
-------------------
A node with ``[main] workers`` > 1 runs that many worker processes under one parent
(``broker.shards.supervisor``). Each worker is the whole broker for the vhosts the shard
map gives it (``placement.worker_of``): their directories are under its own data dir,
``<data_dir>/workers/<i>/`` (``layout``), and no other process opens them.

*Connections.* Every worker listens on the client ports (``SO_REUSEPORT``: the kernel
spreads new connections over them). A worker runs the AMQP handshake up to
connection.open; when that names a vhost another worker owns, ``elsewhere`` says so and
the network layer calls ``hand_over``: the socket goes to the parent with the negotiated
state, the parent passes it to the owner, whose ``on_handover`` continues the connection
(``broker.net.server``). An owner that is down (restarting) means the vhost is unavailable:
the open is refused with 530, and the client retries.

*Shared state* (users and permissions, the vhost list, global parameters) lives in the
node's data dir, one copy for all workers (``SharedFiles``). A change is made under a
node-wide file lock, on the newest copy (re-read first if another worker changed it), and
acknowledged to its client only after every live worker has re-read it: the parent relays a
``reload`` and collects the answers (``shared_changed``). So a user added through one
worker logs in through any worker as soon as the API answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from broker import errors
from broker.shards import control
from broker.shards.placement import worker_of

log = logging.getLogger(__name__)

SHARED_LOCK = ".shared.lock"
CHANGE_TIMEOUT = 30.0  # seconds the parent gets to collect every worker's reload


class SharedFiles:
    """The node-wide files every worker reads (``name -> (path, reload)``), and which of
    them changed since this worker last read or wrote them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.files: dict[str, tuple[Path, Callable[[], None]]] = {}
        self.known: dict[str, tuple[int, int, int] | None] = {}

    def add(self, path: Path, reload: Callable[[], None]) -> None:
        self.files[path.name] = (path, reload)
        self.known[path.name] = _signature(path)

    def snapshot(self) -> dict[str, tuple[int, int, int] | None]:
        return {name: _signature(path) for name, (path, _r) in self.files.items()}

    def refresh(self) -> list[str]:
        """Re-read every file another process replaced since we knew it; their names."""
        done = []
        for name, (path, reload) in self.files.items():
            sig = _signature(path)
            if sig != self.known.get(name):
                reload()
                self.known[name] = sig
                done.append(name)
        return done

    def written(self, before: dict[str, tuple[int, int, int] | None]) -> list[str]:
        """The files this process replaced since ``before`` (now known: no reload of our own write)."""
        now = self.snapshot()
        changed = [name for name in now if now[name] != before.get(name)]
        for name in changed:
            self.known[name] = now[name]
        return changed


def name_logs(index: int) -> None:
    """Log records of this worker process name it (``skred.w1: ...``)."""
    make = logging.getLogRecordFactory()

    def record(*args: object, **kwargs: object) -> logging.LogRecord:
        rec = make(*args, **kwargs)
        rec.name = f"{rec.name}.w{index}"
        return rec

    logging.setLogRecordFactory(record)


def _signature(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


class WorkerLink:
    """This worker's end of the control channel (``broker.amqp.broker.Shards`` for sessions)."""

    replays_login = False  # the owner takes the negotiated state as it is: no credential passes

    def __init__(self, index: int, count: int, sock: socket.socket, root: Path) -> None:
        self.index = index
        self.count = count
        self.sock = sock
        self.root = root
        self.shared = SharedFiles(root)
        self.up: set[int] = set()
        self.http: dict[int, tuple[str, int]] = {}  # each live worker's private HTTP address
        self.metrics: dict[int, tuple[str, int]] = {}  # and its private metrics address
        self.on_handover: Callable[[int, dict[str, Any]], None] = lambda fd, state: os.close(fd)
        self.on_reloaded: Callable[[list[str]], None] = lambda names: None
        self.on_parent_gone: Callable[[], None] = lambda: None
        self._go: asyncio.Event | None = None
        self._waiting: dict[int, asyncio.Future[None]] = {}
        self._next = 0
        self._lock: asyncio.Lock | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------------ placement
    def owner(self, vhost: str) -> int:
        return worker_of(vhost, self.count)

    def owns(self, vhost: str) -> bool:
        return self.owner(vhost) == self.index

    def elsewhere(self, vhost: str) -> bool:
        owner = self.owner(vhost)
        if owner == self.index:
            return False
        if owner not in self.up:
            raise errors.NotAllowed(f"vhost '{vhost}' is unavailable: its worker is restarting")
        return True

    def hand_over(self, fd: int, state: dict[str, Any]) -> None:
        owner = self.owner(str(state["vhost"]))
        control.send(self.sock, {"op": "handover", "to": owner, "state": state}, [fd])

    # ------------------------------------------------------------------ channel
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._go = asyncio.Event()
        self._lock = asyncio.Lock()
        self.sock.settimeout(5.0)
        loop.add_reader(self.sock.fileno(), self._readable)

    def stop(self) -> None:
        if self._loop is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self.sock.fileno())

    async def ready(self, http: tuple[str, int] | None, metrics: tuple[str, int] | None) -> None:
        """Tell the parent this worker has loaded its shards; wait until it says serve (at the
        node's first start, once every worker is ready: no client meets a half-started node)."""
        assert self._go is not None
        control.send(self.sock, {"op": "ready", "http": http, "metrics": metrics})
        await self._go.wait()

    def _readable(self) -> None:
        try:
            got = control.receive(self.sock)
        except (BlockingIOError, TimeoutError):
            return
        except (OSError, ValueError) as exc:
            log.error("control channel to the parent failed: %s", exc)
            got = None
        if got is None:
            self.stop()
            self.on_parent_gone()
            return
        message, fds = got
        op = message["op"]
        if op == "handover" and fds:
            for extra in fds[1:]:
                os.close(extra)
            self.on_handover(fds[0], message["state"])
            return
        for fd in fds:
            os.close(fd)
        if op == "members":
            self.up = set(message["up"])
            self.http = {int(k): (str(v[0]), int(v[1])) for k, v in message["http"].items()}
            self.metrics = {int(k): (str(v[0]), int(v[1])) for k, v in message["metrics"].items()}
        elif op == "go":
            assert self._go is not None
            self._go.set()
        elif op == "reload":
            names = self.shared.refresh()
            if names:
                self.on_reloaded(names)
            control.send(self.sock, {"op": "reloaded", "id": message["id"]})
        elif op == "shared_ok":
            fut = self._waiting.pop(int(message["id"]), None)
            if fut is not None and not fut.done():
                fut.set_result(None)

    # ------------------------------------------------------------------ shared state
    @contextlib.asynccontextmanager
    async def changing(self) -> AsyncIterator[None]:
        """Around a request that may change shared state: the node-wide lock, the newest copy
        of every shared file, and after it every live worker re-reading what changed."""
        assert self._lock is not None
        async with self._lock:
            fd = os.open(self.root / SHARED_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                await asyncio.to_thread(fcntl.flock, fd, fcntl.LOCK_EX)
                names = self.shared.refresh()
                if names:
                    self.on_reloaded(names)
                before = self.shared.snapshot()
                try:
                    yield
                finally:
                    changed = self.shared.written(before)
                    if changed:
                        await self.shared_changed(changed)
            finally:
                os.close(fd)  # releases the lock

    async def shared_changed(self, names: list[str]) -> None:
        assert self._loop is not None
        self._next += 1
        fut: asyncio.Future[None] = self._loop.create_future()
        self._waiting[self._next] = fut
        control.send(self.sock, {"op": "shared", "id": self._next, "names": names})
        try:
            async with asyncio.timeout(CHANGE_TIMEOUT):
                await fut
        except TimeoutError:
            self._waiting.pop(self._next, None)
            log.warning("shared state change (%s): not every worker confirmed it in time", ", ".join(names))
