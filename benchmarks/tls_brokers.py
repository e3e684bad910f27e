"""Private brokers with TLS for benchmarks/tls_cost.py ``--both``: a test CA, a Skred and a
RabbitMQ 3.10 instance of our own (private data dirs, free ports, own epmd), stopped by PID.

RabbitMQ runs from the distribution's package (``/usr/lib/rabbitmq/bin/rabbitmq-server``, the
script behind ``/usr/sbin/rabbitmq-server``) with every directory, the node name, the AMQP, AMQPS
and distribution ports and ``ERL_EPMD_PORT`` its own, so it never meets a system RabbitMQ.
We start epmd ourselves on that port (in the foreground, our child), so both it and the broker
are stopped by the PIDs we hold.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

REPO_ROOT = Path(__file__).resolve().parents[1]
RABBITMQ = "/usr/lib/rabbitmq/bin/rabbitmq-server"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _answers(port: int, probe: bool = True) -> bool:
    """Something accepts on the port (and, with ``probe``, answers the AMQP header)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            if probe:
                s.sendall(b"AMQP\x00\x00\x09\x01")
                return bool(s.recv(8))
            return True
    except OSError:
        return False


def make_certs(dir: Path) -> tuple[Path, Path, Path]:
    """(ca.crt, server.crt, server.key): a CA and a server certificate for localhost/127.0.0.1."""
    dir.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tls_cost CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    paths = dir / "ca.crt", dir / "server.crt", dir / "server.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return paths


class Broker:
    """A started broker: its PID (for CPU time), plain and TLS AMQP URIs."""

    def __init__(self, name: str, proc: subprocess.Popen[bytes], port: int, tls_port: int, ca: Path,
                 extra: list[subprocess.Popen[bytes]] | None = None,
                 relaunch: Callable[[], Broker] | None = None) -> None:
        self.name = name
        self.relaunch = relaunch  # the same broker again: same data dir, node name and ports
        self.proc = proc
        self.port = port
        self.tls_port = tls_port
        self.extra = extra or []
        self.plain_uri = f"amqp://guest:guest@127.0.0.1:{port}/"
        self.tls_uri = f"amqps://guest:guest@localhost:{tls_port}/?cacertfile={ca}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}")
            if _answers(self.port) and _answers(self.tls_port, probe=False):
                return
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready after {timeout:.0f}s")

    def stop(self, timeout: float = 60) -> None:
        for proc in [self.proc, *self.extra]:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)  # its own session: only what it started
                    proc.wait(10)


def start_skred(work: Path, ca: Path, cert: Path, key: Path,
                ports: tuple[int, int, int, int] | None = None) -> Broker:
    """A Skred on ``ports`` (AMQP, AMQPS, management, metrics; default: free ones)."""
    ports = ports or (free_port(), free_port(), free_port(), free_port())
    port, tls_port, mgmt_port, metrics_port = ports
    argv = [sys.executable, "-m", "broker", "--data-dir", str(work / "skred-data"),
            "--amqp-bind", "127.0.0.1", "--amqp-port", str(port), "--amqp-tls-port", str(tls_port),
            "--mgmt-port", str(mgmt_port),
            "--mgmt-tls-port", "-1", "--mgmt-metrics-port", str(metrics_port), "--no-lmq",
            "--tls-cert", str(cert), "--tls-key", str(key), "--tls-ca-cert", str(ca)]
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    with open(work / "skred.log", "ab") as log:
        proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    return Broker("Skred", proc, port, tls_port, ca,
                  relaunch=lambda: start_skred(work, ca, cert, key, ports))


def start_rabbitmq(work: Path, ca: Path, cert: Path, key: Path,
                   ports: tuple[int, int, int, int] | None = None) -> Broker:
    """A RabbitMQ on ``ports`` (AMQP, AMQPS, distribution, epmd; default: free ones); the
    node name follows the epmd port, so the same ports find the same data again."""
    base = work / "rabbitmq"
    base.mkdir(parents=True, exist_ok=True)
    ports = ports or (free_port(), free_port(), free_port(), free_port())
    port, tls_port, dist, epmd_port = ports
    conf = base / "rabbitmq.conf"
    conf.write_text(
        f"listeners.tcp.default = 127.0.0.1:{port}\n"
        f"listeners.ssl.default = 127.0.0.1:{tls_port}\n"
        f"ssl_options.cacertfile = {ca}\nssl_options.certfile = {cert}\nssl_options.keyfile = {key}\n"
        "ssl_options.verify = verify_none\nssl_options.fail_if_no_peer_cert = false\n"
        "loopback_users = none\n")
    (base / "enabled_plugins").write_text("[].\n")
    (base / "rabbitmq-env.conf").write_text("")
    (base / "advanced.config").write_text("[].\n")
    env = dict(os.environ, HOME=str(base), ERL_EPMD_PORT=str(epmd_port),
               RABBITMQ_NODENAME=f"tlscost{epmd_port}@localhost", RABBITMQ_DIST_PORT=str(dist),
               RABBITMQ_CONFIG_FILE=str(conf), RABBITMQ_ADVANCED_CONFIG_FILE=str(base / "advanced.config"),
               RABBITMQ_CONF_ENV_FILE=str(base / "rabbitmq-env.conf"),
               RABBITMQ_ENABLED_PLUGINS_FILE=str(base / "enabled_plugins"),
               RABBITMQ_MNESIA_BASE=str(base / "mnesia"), RABBITMQ_LOG_BASE=str(base / "log"),
               RABBITMQ_PID_FILE=str(base / "rabbitmq.pid"),
               RABBITMQ_PLUGINS_EXPAND_DIR=str(base / "plugins"),
               RABBITMQ_FEATURE_FLAGS_FILE=str(base / "feature_flags"),
               RABBITMQ_LOGS=str(base / "rabbit.log"))
    with open(base / "epmd.log", "ab") as log:
        epmd = subprocess.Popen(["epmd", "-port", str(epmd_port)], env=env, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    with open(base / "stdout.log", "ab") as log:
        proc = subprocess.Popen([RABBITMQ], cwd=base, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    return Broker("RabbitMQ", proc, port, tls_port, ca, extra=[epmd],
                  relaunch=lambda: start_rabbitmq(work, ca, cert, key, ports))


def beam_pid(shell_pid: int) -> int:
    """The Erlang VM under the rabbitmq-server script (whose CPU time is the broker's)."""
    for _ in range(3):
        children = Path(f"/proc/{shell_pid}/task/{shell_pid}/children").read_text().split()
        for child in children:
            if "beam" in Path(f"/proc/{child}/comm").read_text():
                return int(child)
        if children:
            shell_pid = int(children[0])
    return shell_pid
