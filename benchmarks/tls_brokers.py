"""Private brokers with TLS for benchmarks/tls_cost.py ``--both``: a test CA, a Skred and a
RabbitMQ 3.10 instance of our own (private data dirs, free ports, own epmd), stopped by PID.

RabbitMQ is the conformance harness's private node (tests/integration/conformance/_rabbit.py,
``RabbitProcess``: the distribution's package with every directory, the node name, the ports and
``ERL_EPMD_PORT`` its own, so it never meets a system RabbitMQ; epmd and the node are our
children, stopped by the PIDs we hold), here without the management plugin and with an AMQPS
listener. Its CPU time is read from the Erlang VM under the start script (``beam_pid``).
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
sys.path.insert(0, str(REPO_ROOT))

from tests.integration._support import amqp_answers, free_port  # noqa: E402  (needs the repo root)
from tests.integration.conformance._rabbit import RabbitProcess  # noqa: E402


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
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
    """A started broker: its PID (for CPU time), plain and TLS AMQP URIs; ``relaunch`` starts
    the same broker again (same data, node name and ports) once it is stopped."""

    name = "Skred"

    def __init__(self, proc: subprocess.Popen[bytes], port: int, tls_port: int, ca: Path,
                 relaunch: Callable[[], Broker] | None = None) -> None:
        self.proc = proc
        self.relaunch = relaunch
        self.port = port
        self.tls_port = tls_port
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
            if amqp_answers("127.0.0.1", self.port) and _accepts(self.tls_port):
                return
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready after {timeout:.0f}s")

    def stop(self, timeout: float = 60) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: only what it started
                self.proc.wait(10)


class RabbitBroker(Broker):
    """The private RabbitMQ node behind the same face; ``pid`` is its Erlang VM."""

    name = "RabbitMQ"

    def __init__(self, node: RabbitProcess, ca: Path) -> None:
        assert node.proc is not None and node.tls_port is not None
        super().__init__(node.proc, node.port, node.tls_port, ca, relaunch=self._respawn)
        self.node = node
        self.ca = ca

    def _respawn(self) -> Broker:
        self.node.spawn()  # same node name, ports and mnesia dir: the same data
        return RabbitBroker(self.node, self.ca)

    @property
    def pid(self) -> int:
        return self.node.beam_pid()

    def wait_ready(self, timeout: float) -> None:
        problem = self.node.wait_ready(timeout)
        if problem:
            raise RuntimeError(problem)

    def stop(self, timeout: float = 60) -> None:
        self.node.close(timeout)


def start_skred(work: Path, ca: Path, cert: Path, key: Path,
                ports: tuple[int, int, int, int] | None = None, path: Path | None = None,
                extra: tuple[str, ...] = (), tree: Path | None = None) -> Broker:
    """A Skred on ``ports`` (AMQP, AMQPS, management, metrics; default: free ones); ``path``, a
    directory put before the repository on its PYTHONPATH (an instrument's sitecustomize);
    ``extra``, more of its options; ``tree``, a checkout of another commit to run instead of
    this one (its directory is the broker's working directory, first on ``python -m``'s path)."""
    ports = ports or (free_port(), free_port(), free_port(), free_port())
    port, tls_port, mgmt_port, metrics_port = ports
    argv = [sys.executable, "-m", "broker", "--data-dir", str(work / "skred-data"),
            "--amqp-bind", "127.0.0.1", "--amqp-port", str(port), "--amqp-tls-port", str(tls_port),
            "--mgmt-port", str(mgmt_port),
            "--mgmt-tls-port", "-1", "--mgmt-metrics-port", str(metrics_port), "--no-lmq",
            "--tls-cert", str(cert), "--tls-key", str(key), "--tls-ca-cert", str(ca), *extra]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(p) for p in (path, REPO_ROOT) if p))
    with open(work / "skred.log", "ab") as log:
        proc = subprocess.Popen(argv, cwd=tree or REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    return Broker(proc, port, tls_port, ca,
                  relaunch=lambda: start_skred(work, ca, cert, key, ports, path, extra, tree))


def start_rabbitmq(work: Path, ca: Path, cert: Path, key: Path) -> Broker:
    node = RabbitProcess(work / "rabbitmq", management=False, tls=(ca, cert, key), name="tlscost")
    node.spawn()
    return RabbitBroker(node, ca)
