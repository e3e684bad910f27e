"""A private RabbitMQ node: for the conformance harness and for benchmarks/tls_cost.py (the one
place a RabbitMQ of our own is started; benchmarks/tls_brokers.py imports it).

Theory of operation: Debian's ``rabbitmq-server`` package is installed by ``.ci/run`` without its
service running. ``RabbitProcess`` boots a node of its own under a temp directory: its own mnesia,
log and plugin-expansion directories, a node name nobody else uses, the AMQP listener, the
management plugin, the Erlang distribution port and an ``epmd`` of its own all on free ports
(found by binding port 0), and ``HOME`` in the temp dir so the Erlang cookie is private too. The
``epmd`` is started by us in the foreground (``epmd -port N``) before the node, so the node never
daemonises one we could not stop. Readiness is polled (AMQP ``connection.start`` and an HTTP 200
from ``/api/overview``) under a deadline; a node that dies first fails with its log tail. ``close``
sends SIGTERM to the node's process group (RabbitMQ stops cleanly on it), escalates to SIGKILL
after a deadline, then stops that epmd by its PID.

Options: ``plugins`` names more plugins to enable (``rabbitmq_shovel``); ``stream=True`` enables
the ``rabbitmq_stream`` plugin on ``stream_port`` (advertised as 127.0.0.1, so stream clients
reconnect to it); ``management=False`` leaves the management plugin out (a benchmark measuring the node's
CPU time does not want its statistics collection; ``mgmt_port`` is then None); ``tls`` (CA,
certificate and key files) adds an AMQPS listener on ``tls_port`` that does not ask clients for
certificates, and readiness then waits for it to accept too; ``mqtt=True`` enables the
``rabbitmq_mqtt`` plugin with a listener on ``mqtt_port`` and ``rabbitmq_web_mqtt`` on
``web_mqtt_port`` (MQTT over WebSocket, path ``/ws``) (the MQTT conformance harness).
``beam_pid`` is the Erlang VM's PID under the start script: the process whose CPU time is the
broker's.

When RabbitMQ is not installed, ``missing()`` says why; the fixture skips with that reason, or
fails when ``SKRED_REQUIRE_RABBITMQ`` is set (``.ci/run`` sets it, so CI can never skip).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, NoReturn

import pytest

from .._support import SkredProcess, amqp_answers, free_port, group_alive, stop_group

# Debian's real start script (the /usr/sbin one su's to the rabbitmq user); another install (a
# generic-unix tarball) can be named with SKRED_RABBITMQ_SERVER.
SERVER = os.environ.get("SKRED_RABBITMQ_SERVER", "/usr/lib/rabbitmq/bin/rabbitmq-server")
BOOT_DEADLINE = 90.0  # a node boots in 5-15 s on an idle machine; CI machines are shared
STOP_DEADLINE = 20.0


def missing() -> str | None:
    if not os.access(SERVER, os.X_OK) or shutil.which("epmd") is None:
        return (f"RabbitMQ is not installed ({SERVER} and epmd; Debian package rabbitmq-server, "
                "or SKRED_RABBITMQ_SERVER naming its rabbitmq-server script)")
    return None


def require() -> None:
    """Skip the test when RabbitMQ is not installed, or fail it when ``SKRED_REQUIRE_RABBITMQ`` is
    set (CI sets it: a skip there would hide that the comparison never ran)."""
    why = missing()
    if why:
        if os.environ.get("SKRED_REQUIRE_RABBITMQ"):
            pytest.fail(f"SKRED_REQUIRE_RABBITMQ is set but {why}")
        pytest.skip(why)


class RabbitProcess:
    """One RabbitMQ node (with the management plugin unless told otherwise), bound to 127.0.0.1
    on free ports."""

    def __init__(self, root: Path, *, management: bool = True, tls: tuple[Path, Path, Path] | None = None,
                 name: str = "skredconf", plugins: tuple[str, ...] = (), mqtt: bool = False,
                 stream: bool = False) -> None:
        self.root = root
        self.plugins = plugins  # more plugins to enable (the shovel tests: rabbitmq_shovel)
        self.host = "127.0.0.1"
        self.port = free_port()
        self.mgmt_port = free_port() if management else None
        self.tls = tls  # (CA, certificate, key)
        self.tls_port = free_port() if tls else None
        self.mqtt_port = free_port() if mqtt else None
        self.web_mqtt_port = free_port() if mqtt else None  # rabbitmq_web_mqtt (path /ws) beside it
        self.stream_port = free_port() if stream else None  # the rabbitmq_stream plugin's listener
        self.dist_port = free_port()
        self.epmd_port = free_port()
        self.node = f"{name}{uuid.uuid4().hex[:8]}@localhost"
        self.log_path = root / "rabbitmq.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.epmd: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def _write_config(self) -> dict[str, str]:
        for d in ("home", "mnesia", "log", "expand"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        conf = f"listeners.tcp.1 = {self.host}:{self.port}\n"
        if self.mgmt_port is not None:
            conf += (f"management.tcp.ip = {self.host}\n"
                     f"management.tcp.port = {self.mgmt_port}\n"
                     # stats keys ("messages", "consumers") appear in the API after the first emission
                     "collect_statistics_interval = 500\n")
        if self.tls is not None:
            ca, cert, key = self.tls
            conf += (f"listeners.ssl.1 = {self.host}:{self.tls_port}\n"
                     f"ssl_options.cacertfile = {ca}\nssl_options.certfile = {cert}\n"
                     f"ssl_options.keyfile = {key}\n"
                     "ssl_options.verify = verify_none\nssl_options.fail_if_no_peer_cert = false\n")
        if self.mqtt_port is not None:
            conf += f"mqtt.listeners.tcp.1 = {self.host}:{self.mqtt_port}\n"
        if self.web_mqtt_port is not None:
            conf += f"web_mqtt.tcp.ip = {self.host}\nweb_mqtt.tcp.port = {self.web_mqtt_port}\n"
        if self.stream_port is not None:
            conf += (f"stream.listeners.tcp.1 = {self.host}:{self.stream_port}\n"
                     f"stream.advertised_host = {self.host}\nstream.advertised_port = {self.stream_port}\n")
        plugins = ",".join((*(p for p, on in (("rabbitmq_management", self.mgmt_port is not None),
                                               ("rabbitmq_mqtt", self.mqtt_port is not None),
                                               ("rabbitmq_web_mqtt", self.web_mqtt_port is not None),
                                               ("rabbitmq_stream", self.stream_port is not None)) if on),
                            *self.plugins))
        (self.root / "enabled_plugins").write_text(f"[{plugins}].\n")
        (self.root / "rabbitmq-env.conf").write_text("")
        (self.root / "rabbitmq.conf").write_text(conf)
        env = dict(os.environ)
        env.update({
            "HOME": str(self.root / "home"),
            "ERL_EPMD_PORT": str(self.epmd_port),
            "RABBITMQ_NODENAME": self.node,
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_MNESIA_BASE": str(self.root / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.root / "log"),
            "RABBITMQ_LOGS": "-",
            "RABBITMQ_PLUGINS_EXPAND_DIR": str(self.root / "expand"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.root / "enabled_plugins"),
            "RABBITMQ_CONFIG_FILE": str(self.root / "rabbitmq.conf"),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(self.root / "advanced.config"),
            "RABBITMQ_CONF_ENV_FILE": str(self.root / "rabbitmq-env.conf"),
            "RABBITMQ_PID_FILE": str(self.root / "rabbitmq.pid"),
        })
        return env

    def spawn(self) -> None:
        """Start epmd and the node; ``wait_ready`` polls for readiness."""
        env = self._write_config()
        self._log = open(self.log_path, "ab")
        self.epmd = subprocess.Popen(
            ["epmd", "-port", str(self.epmd_port)], stdout=self._log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True)
        # the node registers with epmd at boot and dies ("nodistribution") if it is not listening yet
        deadline = time.monotonic() + 10
        while not self._accepts(self.epmd_port) and time.monotonic() < deadline:
            time.sleep(0.02)  # poll interval, bounded by the deadline
        self.proc = subprocess.Popen(
            [SERVER], cwd=str(self.root), env=env, stdout=self._log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True)

    def _http_ready(self) -> bool:
        if self.mgmt_port is None:
            return True
        req = urllib.request.Request(f"http://{self.host}:{self.mgmt_port}/api/overview")
        req.add_header("Authorization", "Basic Z3Vlc3Q6Z3Vlc3Q=")  # guest:guest
        try:
            with urllib.request.urlopen(req, timeout=2) as resp:
                return int(resp.status) == 200
        except OSError:
            return False

    def _ports_accept(self) -> bool:
        return all(self._accepts(port) for port in (self.tls_port, self.mqtt_port, self.web_mqtt_port,
                                                        self.stream_port))

    def _accepts(self, port: int | None) -> bool:
        """True when ``port`` (None: no such listener) accepts a connection."""
        if port is None:
            return True
        try:
            with socket.create_connection((self.host, port), timeout=1):
                return True
        except OSError:
            return False

    def wait_ready(self, timeout: float = BOOT_DEADLINE) -> str | None:
        """None when the node answers AMQP (and HTTP, and accepts on the TLS and MQTT ports, when
        it has them), else why not (with the log tail)."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return f"RabbitMQ exited with {self.proc.returncode} while booting:\n{self.log_tail()}"
            if amqp_answers(self.host, self.port) and self._http_ready() and self._ports_accept():
                return None
            time.sleep(0.2)  # poll interval of a readiness loop with a deadline
        return f"RabbitMQ not ready within {timeout:.0f}s:\n{self.log_tail()}"

    def beam_pid(self) -> int:
        """The Erlang VM under the rabbitmq-server script (whose CPU time is the broker's)."""
        assert self.proc is not None
        pid = self.proc.pid
        for _ in range(3):  # the script, a shell it runs the VM from, the VM
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            for child in children:
                if "beam" in Path(f"/proc/{child}/comm").read_text():
                    return int(child)
            if children:
                pid = int(children[0])
        return pid

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def close(self, deadline_s: float = STOP_DEADLINE) -> None:
        """Stop the node (``deadline_s`` for a clean stop before SIGKILL: a benchmark with a
        backlog of millions gives it minutes) and its epmd. ``spawn`` starts it again."""
        stop_group(self.proc, deadline_s)
        stop_group(self.epmd)
        if self._log is not None:
            self._log.close()
            self._log = None


@contextmanager
def booted_beside(rabbit: RabbitProcess, root: Path, skreds: int = 1,
                  fail: Callable[[str], NoReturn] = pytest.fail) -> Iterator[list[SkredProcess]]:
    """``rabbit`` and ``skreds`` Skred nodes with their management API, booted side by side:
    the Erlang VM boots (5-15 s) while the Skred nodes start. ``fail(why)`` when RabbitMQ does
    not come up. Everything is stopped by PID at the end, RabbitMQ with SIGKILL: a reference
    node proves nothing by stopping cleanly, and its graceful stop takes seconds."""
    from ..test_mgmt_api import start_mgmt_broker  # the management test module imports this one's users

    started: list[SkredProcess] = []
    try:
        rabbit.spawn()
        for _ in range(skreds):
            started.append(start_mgmt_broker(root))
        problem = rabbit.wait_ready()
        if problem:
            fail(problem)
        yield started
    finally:
        for skred in started:
            skred.close()
        if rabbit.proc is not None and group_alive(rabbit.proc.pid):
            os.killpg(rabbit.proc.pid, signal.SIGKILL)
        rabbit.close()
