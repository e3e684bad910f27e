"""AMQPS and HTTPS: pika and aio-pika over TLS, refused handshakes, mutual TLS and EXTERNAL,
TLS details in /api/connections, plain listeners off.

Certificates are made per module by ``_tls.make_pki`` (a CA, a server certificate for
localhost/127.0.0.1, a client certificate with CN ``tls-user``).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import aio_pika
import pika
import pytest

from ._support import REPO_ROOT, Progress, SkredProcess, free_port, run_async, wait_until
from ._tls import PKI, issue, make_ca, make_pki, tls_args

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    return make_pki(tmp_path_factory.mktemp("pki"))


class TLSBroker:
    def __init__(self, proc: SkredProcess, tls_port: int, https_port: int) -> None:
        self.proc = proc
        self.tls_port = tls_port
        self.https_port = https_port


@pytest.fixture
def tls_broker_factory(tmp_path: Path, pki: PKI) -> Any:
    made: list[SkredProcess] = []

    def start(*extra: str, plain: bool = True) -> TLSBroker:
        tls_port, https_port = free_port(), free_port()
        args = tls_args(pki, "--amqp-tls-port", str(tls_port), "--mgmt-tls-port", str(https_port), *extra)
        p = SkredProcess(tmp_path / f"data-{uuid.uuid4().hex[:6]}", args)
        made.append(p)
        if plain:
            p.start()
        else:
            p.port = -1  # the harness passes --amqp-port: -1 turns the plain listener off
            p.spawn()
        assert p.pid is not None
        progress = Progress(p.pid, p.log_path)  # a deadline counted from progress: load slows a start
        while not (tls_answers(tls_port, pki) or not p.alive()):
            assert not progress.expired(), f"no AMQPS listener:\n{p.log_tail()}"
            time.sleep(0.05)  # poll interval of a readiness loop with a deadline
        assert p.alive(), p.log_tail()
        return TLSBroker(p, tls_port, https_port)

    yield start
    for p in made:
        p.close()


def tls_answers(port: int, pki: PKI) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as raw:
            ctx = pki.client_context(cert=pki.client)  # also answers with tls_fail_if_no_peer_cert
            with ctx.wrap_socket(raw, server_hostname="localhost") as s:
                s.sendall(b"AMQP\x00\x00\x09\x01")
                return len(s.recv(7)) == 7
    except (OSError, ssl.SSLError):
        return False


def params(port: int, ctx: ssl.SSLContext, **kw: Any) -> pika.ConnectionParameters:
    return pika.ConnectionParameters("localhost", port, ssl_options=pika.SSLOptions(ctx, "localhost"),
                                     socket_timeout=5, connection_attempts=1, **kw)


def api(b: TLSBroker, pki: PKI, method: str, path: str, body: Any = None,
        user: str = "guest", password: str = "guest") -> Any:
    req = urllib.request.Request(f"https://localhost:{b.https_port}{path}", method=method,
                                 data=None if body is None else json.dumps(body).encode())
    req.add_header("Authorization", "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode())
    req.add_header("Content-Type", "application/json")
    # the HTTPS listener shares [main] tls_*: present the client certificate in case it is required
    with urllib.request.urlopen(req, context=pki.client_context(cert=pki.client), timeout=10) as resp:
        raw = resp.read()
        return json.loads(raw) if raw else None


def add_user(b: TLSBroker, pki: PKI, name: str) -> None:
    quoted = urllib.request.quote(name, safe="")
    api(b, pki, "PUT", f"/api/users/{quoted}", {"password": "", "tags": ""})
    api(b, pki, "PUT", f"/api/permissions/%2F/{quoted}", {"configure": ".*", "write": ".*", "read": ".*"})


def connections(b: TLSBroker, pki: PKI) -> list[dict[str, Any]]:
    return list(api(b, pki, "GET", "/api/connections"))


# ------------------------------------------------------------------ AMQPS, HTTPS
def test_pika_over_tls_publishes_with_confirms_and_consumes(tls_broker_factory: Any, pki: PKI) -> None:
    b = tls_broker_factory()
    conn = pika.BlockingConnection(params(b.tls_port, pki.client_context()))
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        q = ch.queue_declare("", exclusive=True).method.queue
        bodies = [f"m{i}".encode() * 50 for i in range(200)]
        for body in bodies:
            ch.basic_publish("", q, body, pika.BasicProperties(delivery_mode=2), mandatory=True)
        got: list[bytes] = []
        for _m, _p, body in ch.consume(q, auto_ack=False, inactivity_timeout=5):
            assert body is not None, "consumer stalled over TLS"
            got.append(body)
            ch.basic_ack(_m.delivery_tag)
            if len(got) == len(bodies):
                break
        assert got == bodies
        # /api/connections (over HTTPS) shows the TLS details as RabbitMQ names them
        (entry,) = [c for c in connections(b, pki) if c["port"] == b.tls_port]
        assert entry["ssl"] is True
        assert entry["ssl_protocol"] in ("tlsv1.2", "tlsv1.3")
        assert entry["ssl_cipher"]
        assert entry["peer_cert_subject"] is None  # no client certificate asked for
    finally:
        conn.close()


def test_aio_pika_over_tls(tls_broker_factory: Any, pki: PKI) -> None:
    b = tls_broker_factory()

    async def scenario() -> list[bytes]:
        conn = await aio_pika.connect(host="localhost", port=b.tls_port, ssl=True,
                                      ssl_context=pki.client_context(), timeout=10)
        async with conn:
            ch = await conn.channel(publisher_confirms=True)
            q = await ch.declare_queue("", exclusive=True)
            for i in range(100):
                await ch.default_exchange.publish(aio_pika.Message(f"a{i}".encode()), routing_key=q.name)
            got: list[bytes] = []
            async with q.iterator() as it:
                async for msg in it:
                    await msg.ack()
                    got.append(msg.body)
                    if len(got) == 100:
                        break
            return got

    assert run_async(scenario()) == [f"a{i}".encode() for i in range(100)]


def test_client_that_does_not_trust_the_server_ca_is_refused(tls_broker_factory: Any, pki: PKI,
                                                               tmp_path: Path) -> None:
    b = tls_broker_factory()
    other = make_ca(tmp_path / "other", "Some other CA")
    with pytest.raises((pika.exceptions.AMQPConnectionError, ssl.SSLError)):
        pika.BlockingConnection(params(b.tls_port, pki.client_context(ca=other.cert_path)))
    assert b.proc.alive()


def _handshake(port: int, ctx: ssl.SSLContext) -> str:
    """Complete a TLS handshake and one AMQP header exchange; returns the negotiated version."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        with ctx.wrap_socket(raw, server_hostname="localhost") as s:
            s.sendall(b"AMQP\x00\x00\x09\x01")
            if len(s.recv(7)) != 7:
                raise ConnectionError("no connection.start")
            return str(s.version())


def _old_client(pki: PKI, version: ssl.TLSVersion) -> ssl.SSLContext:
    ctx = pki.client_context()
    ctx.set_ciphers("DEFAULT:@SECLEVEL=0")  # let the client itself offer an old protocol
    ctx.minimum_version = ctx.maximum_version = version
    return ctx


@pytest.mark.filterwarnings("ignore:ssl.TLSVersion.TLSv1_1 is deprecated:DeprecationWarning")
def test_tls_1_1_refused_and_min_version_enforced(tls_broker_factory: Any, pki: PKI) -> None:
    b = tls_broker_factory()
    assert _handshake(b.tls_port, _old_client(pki, ssl.TLSVersion.TLSv1_2)) == "TLSv1.2"
    with pytest.raises((ssl.SSLError, OSError)):
        _handshake(b.tls_port, _old_client(pki, ssl.TLSVersion.TLSv1_1))
    strict = tls_broker_factory("--tls-min-version", "1.3")
    with pytest.raises((ssl.SSLError, OSError)):
        _handshake(strict.tls_port, _old_client(pki, ssl.TLSVersion.TLSv1_2))
    assert _handshake(strict.tls_port, pki.client_context()) == "TLSv1.3"


def test_https_management_api_and_rabbitmqadmin_ssl_options(tls_broker_factory: Any, pki: PKI) -> None:
    b = tls_broker_factory()
    overview = api(b, pki, "GET", "/api/overview")
    protocols = {entry["protocol"]: entry["port"] for entry in overview["listeners"]}
    assert protocols["amqp/ssl"] == b.tls_port and protocols["https"] == b.https_port
    # plain HTTP on the HTTPS port is not served
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://localhost:{b.https_port}/api/overview", timeout=5).read()
    admin = shutil.which("rabbitmqadmin")
    if admin is None:
        return  # the urllib checks above already covered HTTPS
    out = subprocess.run(
        [admin, "-H", "localhost", "-P", str(b.https_port), "-u", "guest", "-p", "guest", "--ssl",
         "--ssl-ca-cert-file", str(pki.ca.cert_path), "-f", "raw_json", "list", "vhosts", "name"],
        capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert {"name": "/"} in json.loads(out.stdout)


def test_plain_listeners_can_be_turned_off(tls_broker_factory: Any, pki: PKI) -> None:
    b = tls_broker_factory("--mgmt-port", "-1", plain=False)
    log = b.proc.log_text()
    assert "AMQPS listening" in log and "AMQP listening" not in log
    assert "management HTTPS API listening" in log and "management HTTP API listening" not in log
    assert api(b, pki, "GET", "/api/overview")["node"]


# --------------------------------------------------------------- mutual TLS, EXTERNAL
def test_external_login_with_a_client_certificate(tls_broker_factory: Any, pki: PKI) -> None:
    b = tls_broker_factory("--tls-verify-peer", "--tls-fail-if-no-peer-cert")
    ctx = pki.client_context(cert=pki.client)
    # a certificate for a user the broker does not know: refused with 403
    external = pika.credentials.ExternalCredentials()
    with pytest.raises(pika.exceptions.ProbableAuthenticationError) as refused:
        pika.BlockingConnection(params(b.tls_port, ctx, credentials=external))
    assert "403" in str(refused.value)
    add_user(b, pki, "tls-user")
    conn = pika.BlockingConnection(params(b.tls_port, ctx, credentials=external))
    try:
        ch = conn.channel()
        q = ch.queue_declare("", exclusive=True).method.queue
        ch.basic_publish("", q, b"hello")
        wait_until(lambda: ch.basic_get(q, auto_ack=True)[2] == b"hello", 5, "message over EXTERNAL login")
        (entry,) = [c for c in connections(b, pki) if c["user"] == "tls-user"]
        assert entry["auth_mechanism"] == "EXTERNAL"
        assert "CN=tls-user" in entry["peer_cert_subject"]
        assert "CN=Skred test CA" in entry["peer_cert_issuer"]
    finally:
        conn.close()


def test_fail_if_no_peer_cert_refuses_clients_without_one(tls_broker_factory: Any, pki: PKI,
                                                          tmp_path: Path) -> None:
    b = tls_broker_factory("--tls-verify-peer", "--tls-fail-if-no-peer-cert")
    with pytest.raises((ssl.SSLError, OSError)):
        _handshake(b.tls_port, pki.client_context())
    # a client certificate from a CA the broker does not trust fails the handshake too
    other = make_ca(tmp_path / "rogue", "Rogue CA")
    rogue = issue(other, tmp_path / "rogue", "tls-user", client=True)
    with pytest.raises((ssl.SSLError, OSError)):
        _handshake(b.tls_port, pki.client_context(cert=rogue))
    assert _handshake(b.tls_port, pki.client_context(cert=pki.client)).startswith("TLS")


def test_verify_peer_without_a_certificate_offers_no_external(tls_broker_factory: Any, pki: PKI) -> None:
    b = tls_broker_factory("--tls-verify-peer")
    with pytest.raises(pika.exceptions.AMQPConnectionError):
        pika.BlockingConnection(params(b.tls_port, pki.client_context(),
                                       credentials=pika.credentials.ExternalCredentials()))
    conn = pika.BlockingConnection(params(b.tls_port, pki.client_context()))  # PLAIN still works
    conn.close()


@pytest.mark.parametrize("source,expected", [("subject_alternative_name", "tls-user.clients.test"),
                                             ("distinguished_name", "CN=tls-user,O=Skred tests")])
def test_cert_login_from(tls_broker_factory: Any, pki: PKI, source: str, expected: str) -> None:
    b = tls_broker_factory("--tls-verify-peer", "--tls-cert-login-from", source)
    add_user(b, pki, expected)
    conn = pika.BlockingConnection(params(b.tls_port, pki.client_context(cert=pki.client),
                                          credentials=pika.credentials.ExternalCredentials()))
    try:
        assert [c["user"] for c in connections(b, pki)] == [expected]
    finally:
        conn.close()


def test_unusable_certificate_is_a_clear_startup_error(tmp_path: Path, pki: PKI) -> None:
    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate")
    p = SkredProcess(tmp_path / "data", ["--tls-cert", str(bad)])
    try:
        proc = p.spawn()
        assert proc.wait(20) == 2
        text = p.log_text()
        assert "tls_cert" in text and "Traceback" not in text
    finally:
        p.close()



# ----------------------------------------------------------------------- SNI, reload
def _served_cn(port: int, pki: PKI, server_name: str | None) -> str:
    """The CN of the certificate the broker serves for ``server_name`` (openssl s_client)."""
    argv = ["openssl", "s_client", "-connect", f"127.0.0.1:{port}", "-CAfile", str(pki.ca.cert_path)]
    argv += ["-servername", server_name] if server_name else ["-noservername"]
    out = ""
    for _ in range(3):  # s_client may quit on its empty stdin before a slow handshake ends
        out = subprocess.run(argv, input="", capture_output=True, text=True, timeout=20).stdout
        for line in out.splitlines():
            if line.startswith("subject="):
                return line.rsplit("CN", 1)[1].lstrip(" =").strip()
    raise AssertionError(f"no certificate in openssl s_client output:\n{out}")


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_sni_picks_the_certificate_by_server_name(tls_broker_factory: Any, pki: PKI) -> None:
    other = issue(pki.ca, pki.dir, "other.test", dns=("other.test",))
    wild = issue(pki.ca, pki.dir, "*.wild.test", dns=("*.wild.test",))
    sni = f"other.test={other.cert}:{other.key}, *.wild.test={wild.cert}:{wild.key}"
    b = tls_broker_factory("--tls-sni", sni)
    assert _served_cn(b.tls_port, pki, "other.test") == "other.test"
    assert _served_cn(b.tls_port, pki, "a.wild.test") == "*.wild.test"
    assert _served_cn(b.tls_port, pki, "localhost") == "localhost"
    assert _served_cn(b.tls_port, pki, "unknown.test") == "localhost"  # the default certificate
    assert _served_cn(b.tls_port, pki, None) == "localhost"
    assert _served_cn(b.https_port, pki, "other.test") == "other.test"  # HTTPS shares the contexts


def _peer_cn(port: int, pki: PKI) -> str:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        with pki.client_context().wrap_socket(raw, server_hostname="localhost") as s:
            cert = s.getpeercert()
    return next(v for rdn in cert["subject"] for k, v in rdn if k == "commonName")


def test_sighup_reloads_certificates_without_dropping_connections(tls_broker_factory: Any,
                                                                  pki: PKI, tmp_path: Path) -> None:
    live = tmp_path / "live"
    live.mkdir()
    first = issue(pki.ca, live, "localhost", dns=("localhost",), ips=("127.0.0.1",))
    b = tls_broker_factory("--tls-cert", str(first.cert), "--tls-key", str(first.key))
    conn = pika.BlockingConnection(params(b.tls_port, pki.client_context()))
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        q = ch.queue_declare("", exclusive=True).method.queue
        ch.basic_publish("", q, b"before")
        assert _peer_cn(b.tls_port, pki) == "localhost"

        renewed = issue(pki.ca, tmp_path, "localhost renewed", dns=("localhost",), ips=("127.0.0.1",))
        shutil.copy(renewed.cert, first.cert)
        shutil.copy(renewed.key, first.key)
        assert b.proc.pid is not None
        os.kill(b.proc.pid, signal.SIGHUP)
        wait_until(lambda: _peer_cn(b.tls_port, pki) == "localhost renewed", 10, "renewed certificate served")
        assert b.proc.alive()
        # the connection opened before the reload still works, both ways
        ch.basic_publish("", q, b"after")
        got = [ch.basic_get(q, auto_ack=True)[2] for _ in range(2)]
        assert got == [b"before", b"after"]

        # a reload that cannot load its files keeps serving the previous certificate
        first.key.write_text("garbage")
        os.kill(b.proc.pid, signal.SIGHUP)
        wait_until(lambda: "TLS reload failed" in b.proc.log_text(), 10, "failed reload logged")
        assert _peer_cn(b.tls_port, pki) == "localhost renewed" and b.proc.alive()
    finally:
        conn.close()


def test_skredctl_over_https_with_a_client_certificate(tls_broker_factory: Any, pki: PKI,
                                                       tmp_path: Path) -> None:
    """skredctl against an HTTPS-only broker that requires client certificates: --cacert verifies
    the broker, --cert/--key present ours; an unknown CA fails unless --insecure is explicit."""
    b = tls_broker_factory("--mgmt-port", "-1", "--tls-verify-peer", "--tls-fail-if-no-peer-cert",
                           plain=False)
    url = f"https://localhost:{b.https_port}"

    def ctl(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "broker.ctl", "--url", url, *args],
                              capture_output=True, text=True, timeout=30, cwd=str(REPO_ROOT))

    good = ctl("--cacert", str(pki.ca.cert_path), "--cert", str(pki.client.cert), "--key",
               str(pki.client.key), "--json", "list", "vhosts")
    assert good.returncode == 0, good.stderr
    assert "/" in {v["name"] for v in json.loads(good.stdout)}
    # rabbitmqadmin's option names work too
    same = ctl("--ssl-ca-cert-file", str(pki.ca.cert_path), "--ssl-cert-file", str(pki.client.cert),
               "--ssl-key-file", str(pki.client.key), "status")
    assert same.returncode == 0 and "node:" in same.stdout, same.stderr

    # the broker's certificate is verified: another CA refuses it, with one line and status 2
    other = make_ca(tmp_path / "other", "Other CA")
    refused = ctl("--cacert", str(other.cert_path), "--cert", str(pki.client.cert), "--key",
                  str(pki.client.key), "status")
    assert refused.returncode == 2 and "CERTIFICATE_VERIFY_FAILED" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr and len(refused.stderr.strip().splitlines()) == 1
    insecure = ctl("--cacert", str(other.cert_path), "--insecure", "--cert", str(pki.client.cert), "--key",
                   str(pki.client.key), "status")
    assert insecure.returncode == 0, insecure.stderr
    # without a client certificate the broker refuses the handshake
    no_cert = ctl("--cacert", str(pki.ca.cert_path), "status")
    assert no_cert.returncode == 2 and "cannot connect" in no_cert.stderr, no_cert.stderr
    # TLS options with a plain URL are a usage error, not silently ignored
    plain = subprocess.run([sys.executable, "-m", "broker.ctl", "--url", "http://127.0.0.1:1", "--insecure",
                            "status"], capture_output=True, text=True, timeout=30, cwd=str(REPO_ROOT))
    assert plain.returncode == 2 and "https://" in plain.stderr


def test_health_checks_see_tls_certificates_and_listeners(tls_broker_factory: Any, pki: PKI) -> None:
    """certificate-expiration reads the configured certificate (valid one more day here);
    port- and protocol-listener know the TLS listeners (RabbitMQ's shapes)."""
    b = tls_broker_factory()
    assert api(b, pki, "GET", "/api/health/checks/certificate-expiration/0/days") == {"status": "ok"}
    with pytest.raises(urllib.error.HTTPError) as ei:
        api(b, pki, "GET", "/api/health/checks/certificate-expiration/2/days")
    assert ei.value.code == 503
    failed = json.loads(ei.value.read())
    assert failed["status"] == "failed" and failed["expired"][0]["certfile"] == str(pki.server.cert)
    assert api(b, pki, "GET", f"/api/health/checks/port-listener/{b.tls_port}")["status"] == "ok"
    for proto in ("amqps", "https"):
        assert api(b, pki, "GET", f"/api/health/checks/protocol-listener/{proto}")["status"] == "ok"
