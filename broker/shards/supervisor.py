"""The parent process of a multi-worker node: starts the workers, restarts the dead, relays.

Theory of operation
-------------------
``serve_workers`` runs in the process ``skred`` started, when ``[main] workers`` > 1 (or 0
on a machine of more than one core). It takes the node's data dir lock, moves vhost
directories the shard map gives to another worker (``layout.relocate``; then the composition
root's ``prepare``: MQTT's state of older layouts into its vhosts' directories), resolves every
client port asked as 0 to a real one (a socket bound with ``SO_REUSEPORT`` and never
listened on keeps it reserved; the workers bind the same port beside it), then forks one
worker per index. A worker is today's broker for the vhosts it owns, built by the
composition root's ``run_worker`` in the child.

The parent is a plain ``selectors`` loop with no threads and no event loop, so it can fork
at any time: it relays control messages (``control``: hand-overs go to their owner,
shared-state changes to every other live worker and, once all have re-read, the
acknowledgment back), reaps workers, and restarts one that died (kill -9 included) after a
back-off that doubles from ``RESTART_FIRST`` up to ``RESTART_MAX`` and is forgotten after
``STABLE`` seconds of life. A worker that fails during the node's first start fails the node
(exit status of the worker: a port in use, a bad data dir), rather than restarting forever.

Signals: SIGTERM and SIGINT stop the node (each worker gets SIGTERM and shuts down as a
single node does; one still running after ``STOP_GRACE`` seconds is killed); SIGHUP is
passed to every worker (each reloads its configuration). A worker whose parent is gone sees
its control channel close and stops.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import selectors
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from broker import tls
from broker.auth.users import UserStore
from broker.auth.vhosts import VHostStore
from broker.config import Config
from broker.errors import ListenError
from broker.shards import control, layout
from broker.store.lock import DataDirLock
from broker.store.sink import NULL_SINK

log = logging.getLogger("skred")

RESTART_FIRST = 0.1  # seconds before the first restart of a worker that died
RESTART_MAX = 5.0
STABLE = 30.0  # a worker up this long has its back-off forgotten
STOP_GRACE = 30.0
# what the composition root does to the data dir after ``layout.relocate``, before any fork: (data
# dir, vhosts, workers). MQTT's state of older layouts into every vhost's directory (broker/node.py).
Prepare = Callable[[Path, list[str], int], None]
_TICK = 0.5


@dataclass
class WorkerSpec:
    """What a worker process is given: who it is, its channel, its config."""

    index: int
    count: int
    sock: socket.socket
    root: Path
    config: Config


@dataclass
class _Worker:
    index: int
    pid: int = 0
    sock: socket.socket | None = None
    ready: bool = False  # loaded its vhosts: connections may be handed to it (it holds them until it serves)
    http: tuple[str, int] | None = None
    metrics: tuple[str, int] | None = None
    started: float = 0.0
    backoff: float = RESTART_FIRST
    restart_at: float | None = None


@dataclass
class _Change:
    origin: int
    origin_id: int
    waiting: set[int] = field(default_factory=set)
    deadline: float = 0.0


def cores() -> int:
    """The cores this process may run on (its CPU affinity: a container's cpuset, taskset)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def worker_count(config: Config) -> int:
    """``[main] workers``, with 0 meaning one per CPU core; a cluster member runs one."""
    if config.clustering.enabled:
        if config.main.workers > 1:  # asked for explicitly: say why it is not done
            log.warning("[main] workers = %d: a cluster member runs one worker until shards lead per "
                        "worker (docs/architecture.md, Workers)", config.main.workers)
        return 1
    return config.main.workers or cores()


def reserve_ports(config: Config) -> tuple[Config, list[socket.socket]]:
    """The config with every client port the workers share made concrete (one asked as 0 gets a
    free one), and the sockets that hold those ports until the node stops.

    Each port is first bound *without* ``SO_REUSEPORT``: that fails when anything is bound
    there, so a second node given the same port fails to start (``ListenError``) instead of
    silently sharing the port with this one (the kernel lets sockets of one user share it
    when all set ``SO_REUSEPORT``). Then a socket with ``SO_REUSEPORT``, bound and never
    listened on, keeps it: the workers bind beside it, and a restarted worker finds it free."""
    held: list[socket.socket] = []
    secure = tls.enabled(config.main)

    def hold(options: str, host: str, port: int, used: bool) -> int:
        if not used or port < 0:
            return port
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind((host, port))
                port = int(probe.getsockname()[1])
            s = socket.socket(family, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            s.bind((host, port))
        except OSError as exc:
            for s in held:
                s.close()
            raise ListenError(options, host, port, exc) from None
        held.append(s)
        return port

    a, m = config.amqp, config.mgmt
    amqp = dataclasses.replace(
        a, port=hold("amqp.bind/amqp.port, --amqp-bind/--amqp-port", a.bind, a.port, True),
        tls_port=hold("amqp.bind/amqp.tls_port, --amqp-bind/--amqp-tls-port", a.bind, a.tls_port, secure))
    mgmt = dataclasses.replace(
        m, port=hold("mgmt.bind/mgmt.port, --mgmt-bind/--mgmt-port", m.bind, m.port, m.enabled),
        tls_port=hold("mgmt.bind/mgmt.tls_port, --mgmt-bind/--mgmt-tls-port", m.bind, m.tls_port,
                      m.enabled and secure),
        metrics_port=hold("mgmt.metrics_bind/mgmt.metrics_port, --mgmt-metrics-bind/--mgmt-metrics-port",
                          m.metrics_bind, m.metrics_port, m.enabled))
    q = config.mqtt
    mqtt = dataclasses.replace(
        q, port=hold("mqtt.bind/mqtt.port, --mqtt-bind/--mqtt-port", q.bind, q.port, q.enabled),
        tls_port=hold("mqtt.bind/mqtt.tls_port, --mqtt-bind/--mqtt-tls-port", q.bind, q.tls_port,
                      q.enabled and secure))
    st = config.stream
    stream = dataclasses.replace(
        st, port=hold("stream.bind/stream.port, --stream-bind/--stream-port", st.bind, st.port, st.enabled),
        tls_port=hold("stream.bind/stream.tls_port, --stream-bind/--stream-tls-port", st.bind, st.tls_port,
                      st.enabled and secure))
    lq = config.lmq  # one worker listens (the owner of [lmq] vhost); the parent holds them all the same
    lmq = dataclasses.replace(
        lq, http_port=hold("lmq.bind/lmq.http_port, --lmq-bind/--lmq-http-port", lq.bind, lq.http_port,
                           lq.enabled),
        rpc_port=hold("lmq.bind/lmq.rpc_port, --lmq-bind/--lmq-rpc-port", lq.bind, lq.rpc_port, lq.enabled))
    return dataclasses.replace(config, amqp=amqp, mgmt=mgmt, mqtt=mqtt, stream=stream, lmq=lmq), held


class Supervisor:
    def __init__(self, config: Config, count: int, run_worker: Callable[[WorkerSpec], int],
                 files: dict[str, int] | None = None, prepare: Prepare | None = None) -> None:
        self.config = config
        self.files = files or {}  # node files a worker keeps (layout.relocate)
        self.prepare = prepare
        self.count = count
        self.root = config.main.data_dir
        self.run_worker = run_worker
        self.workers = [_Worker(i) for i in range(count)]
        self.sel = selectors.DefaultSelector()
        self.changes: dict[int, _Change] = {}
        self._next_change = 0
        self.booting = True
        self.stopping = False
        self.exit_code = 0
        self._signals: list[int] = []
        self._wake_r, self._wake_w = socket.socketpair()
        self._reserved: list[socket.socket] = []
        self._lock_fd: int | None = None

    # ------------------------------------------------------------------ run
    def run(self) -> int:
        lock = DataDirLock(self.root)
        lock.acquire()
        self._lock_fd = lock._fd
        try:
            # the shared files exist before any worker reads them (the first start creates them)
            main = self.config.main
            UserStore(self.root / "users.json", NULL_SINK, main.default_user, main.default_password)
            names = VHostStore(self.root / "vhosts.json", NULL_SINK).list()
            layout.relocate(self.root, names, self.count, self.files)
            if self.prepare is not None:
                self.prepare(self.root, names, self.count)
            self.config, self._reserved = reserve_ports(self.config)  # ListenError: a port is taken
            self._install_signals()
            log.info("starting %d workers (data dir %s, AMQP port %d)", self.count, self.root,
                     self.config.amqp.port)
            for w in self.workers:
                self._spawn(w)
            self._loop()
            return self.exit_code
        finally:
            for s in self._reserved:
                s.close()
            lock.release()

    def _install_signals(self) -> None:
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        signal.set_wakeup_fd(self._wake_w.fileno(), warn_on_full_buffer=False)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, self._signalled)
        self.sel.register(self._wake_r, selectors.EVENT_READ, None)

    def _signalled(self, signum: int, frame: Any) -> None:
        self._signals.append(signum)

    def _loop(self) -> None:
        while True:
            for key, _ev in self.sel.select(_TICK):
                if key.data is None:
                    try:
                        while self._wake_r.recv(512):
                            pass
                    except BlockingIOError:
                        pass
                else:
                    self._from_worker(key.data)
            signals, self._signals = self._signals, []
            for signum in signals:
                if signum in (signal.SIGTERM, signal.SIGINT) and not self.stopping:
                    log.info("stopping %d workers", self.count)
                    self.stopping = True
                    self._signal_all(signal.SIGTERM)
                    self._stop_deadline = time.monotonic() + STOP_GRACE
                elif signum == signal.SIGHUP:
                    self._signal_all(signal.SIGHUP)
            self._reap()
            now = time.monotonic()
            if self.stopping:
                if not any(w.pid for w in self.workers):
                    log.info("all workers stopped")
                    return
                if now > self._stop_deadline:
                    self._signal_all(signal.SIGKILL)
                continue
            for w in self.workers:
                if w.restart_at is not None and now >= w.restart_at:
                    self._spawn(w)
            self._expire_changes(now)

    def _signal_all(self, signum: int) -> None:
        for w in self.workers:
            if w.pid:
                try:
                    os.kill(w.pid, signum)
                except ProcessLookupError:
                    pass

    # ------------------------------------------------------------------ workers
    def _spawn(self, w: _Worker) -> None:
        parent_end, child_end = control.pair()
        w.restart_at = None
        w.ready = False
        w.started = time.monotonic()
        root = self.root
        config = dataclasses.replace(self.config, main=dataclasses.replace(
            self.config.main, data_dir=layout.worker_dir(root, w.index, self.count)))
        pid = os.fork()
        if pid == 0:  # the worker
            code = 1
            try:
                self._in_child(parent_end)
                code = self.run_worker(WorkerSpec(w.index, self.count, child_end, root, config))
            except BaseException:
                log.exception("worker %d failed", w.index)
            finally:
                logging.shutdown()
                os._exit(code)
        child_end.close()
        w.pid = pid
        w.sock = parent_end
        parent_end.setblocking(False)
        self.sel.register(parent_end, selectors.EVENT_READ, w)
        log.info("worker %d started (pid %d)", w.index, pid)

    def _in_child(self, own_parent_end: socket.socket) -> None:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        self.sel.close()
        own_parent_end.close()
        for w in self.workers:
            if w.sock is not None:
                w.sock.close()
        for s in (*self._reserved, self._wake_r, self._wake_w):
            s.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # the parent's: the worker locks its own data dir

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            w = next((w for w in self.workers if w.pid == pid), None)
            if w is None:
                continue
            code = os.waitstatus_to_exitcode(status)
            self._gone(w)
            if self.stopping:
                log.info("worker %d stopped (%s)", w.index, _how(code))
                continue
            if self.booting and not w.ready:
                log.error("worker %d failed to start (%s): stopping the node", w.index, _how(code))
                self.exit_code = code if code > 0 else 1
                self.stopping = True
                self._stop_deadline = time.monotonic() + STOP_GRACE
                self._signal_all(signal.SIGTERM)
                continue
            now = time.monotonic()
            if now - w.started > STABLE:
                w.backoff = RESTART_FIRST
            log.warning("worker %d (pid %d) died (%s): restarting it in %.1f s", w.index, pid, _how(code),
                        w.backoff)
            w.restart_at = now + w.backoff
            w.backoff = min(w.backoff * 2, RESTART_MAX)

    def _gone(self, w: _Worker) -> None:
        w.pid = 0
        w.ready = False
        if w.sock is not None:
            self.sel.unregister(w.sock)
            w.sock.close()
            w.sock = None
        for change in self.changes.values():
            change.waiting.discard(w.index)
        self._settle_changes()
        self._announce()

    # ------------------------------------------------------------------ messages
    def _from_worker(self, w: _Worker) -> None:
        sock = w.sock
        if sock is None:
            return
        while True:
            try:
                got = control.receive(sock)
            except BlockingIOError:
                return
            except ConnectionResetError:  # the worker is gone: _reap tells how
                got = None
            except (OSError, ValueError) as exc:
                log.warning("worker %d: bad control message: %s", w.index, exc)
                return
            if got is None:
                self.sel.unregister(sock)
                sock.close()
                w.sock = None
                return
            self._handle(w, *got)

    def _handle(self, w: _Worker, message: dict[str, Any], fds: list[int]) -> None:
        op = message["op"]
        try:
            if op == "handover":
                target = self.workers[int(message["to"])]
                if target.sock is not None and target.ready and fds:
                    self._send(target, {"op": "handover", "state": message["state"]}, fds[:1])
            elif op == "ready":
                w.ready = True
                w.http, w.metrics = _address(message.get("http")), _address(message.get("metrics"))
                self._announce()
                if not self.booting:
                    self._send(w, {"op": "go"})
                elif all(x.ready for x in self.workers):
                    self.booting = False
                    log.info("all %d workers ready", self.count)
                    for x in self.workers:
                        self._send(x, {"op": "go"})
            elif op == "shared":
                self._next_change += 1
                cid = self._next_change
                others = {x.index for x in self.workers if x.index != w.index and x.sock is not None}
                self.changes[cid] = _Change(w.index, int(message["id"]), others, time.monotonic() + 20.0)
                for x in self.workers:
                    if x.index in others:
                        self._send(x, {"op": "reload", "id": cid, "names": message.get("names", [])})
                self._settle_changes()
            elif op == "reloaded":
                change = self.changes.get(int(message["id"]))
                if change is not None:
                    change.waiting.discard(w.index)
                    self._settle_changes()
        finally:
            for fd in fds:
                os.close(fd)

    def _settle_changes(self) -> None:
        for cid, change in list(self.changes.items()):
            if not change.waiting:
                del self.changes[cid]
                origin = self.workers[change.origin]
                if origin.sock is not None:
                    self._send(origin, {"op": "shared_ok", "id": change.origin_id})

    def _expire_changes(self, now: float) -> None:
        for change in self.changes.values():
            if now > change.deadline:
                log.warning("workers %s did not confirm a shared state change", sorted(change.waiting))
                change.waiting.clear()
        self._settle_changes()

    def _announce(self) -> None:
        up = [x.index for x in self.workers if x.ready and x.sock is not None]
        http = {x.index: x.http for x in self.workers if x.ready and x.http is not None}
        metrics = {x.index: x.metrics for x in self.workers if x.ready and x.metrics is not None}
        for x in self.workers:
            if x.sock is not None:
                self._send(x, {"op": "members", "up": up, "http": http, "metrics": metrics})

    def _send(self, w: _Worker, message: dict[str, Any], fds: list[int] | None = None) -> None:
        if w.sock is None:
            return
        try:
            control.send(w.sock, message, fds)
        except OSError as exc:
            log.warning("worker %d: control message not delivered: %s", w.index, exc)


def _address(value: Any) -> tuple[str, int] | None:
    return (str(value[0]), int(value[1])) if value else None


def _how(code: int) -> str:
    return f"signal {-code}" if code < 0 else f"exit status {code}"


def serve_workers(config: Config, count: int, run_worker: Callable[[WorkerSpec], int],
                  files: dict[str, int] | None = None, prepare: Prepare | None = None) -> int:
    return Supervisor(config, count, run_worker, files, prepare).run()
