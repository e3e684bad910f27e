"""PROXY protocol v1 and v2 on the AMQP, AMQPS and management listeners: honoured from trusted
sources (the real client address shows in /api/connections and decides the loopback-only rule),
refused from anyone else.

A relay in the test plays HAProxy: it connects to the broker from 127.0.0.2 (trusted) or
127.0.0.3 (not) and sends a header naming 203.0.113.9 before splicing the client through.
"""

from __future__ import annotations

import base64
import json
import socket
import ssl
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pika
import pytest

from broker.net import proxy

from ._relay import Relay
from ._support import SkredProcess, free_port, wait_until
from ._tls import make_pki, tls_args

pytestmark = pytest.mark.timeout(120)
REAL_CLIENT = ("203.0.113.9", 4242)


def v2(_client: tuple[str, int]) -> bytes:
    return proxy.encode_v2(REAL_CLIENT, ("127.0.0.1", 5672))


def v1(_client: tuple[str, int]) -> bytes:
    return proxy.encode_v1(REAL_CLIENT, ("127.0.0.1", 5672))


@pytest.fixture
def relays() -> Iterator[Callable[..., Relay]]:
    made: list[Relay] = []

    def make(*args: Any, **kw: Any) -> Relay:
        r = Relay(*args, **kw)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


def http(port: int, path: str, user: str, password: str, method: str = "GET", body: Any = None,
         context: ssl.SSLContext | None = None) -> tuple[int, Any]:
    scheme = "https" if context else "http"
    req = urllib.request.Request(f"{scheme}://localhost:{port}{path}", method=method,
                                 data=None if body is None else json.dumps(body).encode())
    req.add_header("Authorization", "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode())
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=10, context=context) as resp:
            raw = resp.read()
            return int(resp.status), json.loads(raw) if raw else None
    except urllib.error.HTTPError as exc:
        return int(exc.code), None


def add_remote_user(b: SkredProcess) -> None:
    assert http(b.mgmt_port, "/api/users/remote", "guest", "guest", "PUT",
                {"password": "secret", "tags": "administrator"})[0] in (201, 204)
    assert http(b.mgmt_port, "/api/permissions/%2F/remote", "guest", "guest", "PUT",
                {"configure": ".*", "write": ".*", "read": ".*"})[0] in (201, 204)


def remote(port: int) -> pika.BlockingConnection:
    return pika.BlockingConnection(pika.ConnectionParameters(
        "127.0.0.1", port, credentials=pika.PlainCredentials("remote", "secret"),
        socket_timeout=5, connection_attempts=1))


@pytest.mark.parametrize("header", [v2, v1], ids=["v2", "v1"])
def test_trusted_proxy_header_shows_the_real_client(broker_factory: Callable[..., SkredProcess],
                                                    relays: Callable[..., Relay],
                                                    header: Callable[[tuple[str, int]], bytes]) -> None:
    b = broker_factory(["--amqp-trusted-proxies", "127.0.0.2/32", "--mgmt-trusted-proxies", "127.0.0.2"])
    add_remote_user(b)
    relay = relays(("127.0.0.1", b.port), source="127.0.0.2", prefix=header)
    conn = remote(relay.port)
    try:
        status, conns = http(b.mgmt_port, "/api/connections", "guest", "guest")
        assert status == 200
        assert [(c["peer_host"], c["peer_port"]) for c in conns] == [REAL_CLIENT]
        # guest is loopback-only: from the real (remote) address it is refused
        with pytest.raises(pika.exceptions.AMQPConnectionError):
            pika.BlockingConnection(pika.ConnectionParameters(
                "127.0.0.1", relay.port, socket_timeout=5, connection_attempts=1))
    finally:
        conn.close()
    # the management listener honours it too: guest is refused from the real address
    hrelay = relays(("127.0.0.1", b.mgmt_port), source="127.0.0.2", prefix=header)
    assert http(hrelay.port, "/api/whoami", "guest", "guest")[0] == 401
    status, me = http(hrelay.port, "/api/whoami", "remote", "secret")
    assert status == 200 and me["name"] == "remote"


def test_proxy_header_from_an_untrusted_source_is_refused(broker_factory: Callable[..., SkredProcess],
                                                          relays: Callable[..., Relay]) -> None:
    b = broker_factory(["--amqp-trusted-proxies", "127.0.0.2/32", "--mgmt-trusted-proxies", "127.0.0.2"])
    add_remote_user(b)
    relay = relays(("127.0.0.1", b.port), source="127.0.0.3", prefix=v2)
    with pytest.raises(pika.exceptions.AMQPConnectionError):
        remote(relay.port)
    hrelay = relays(("127.0.0.1", b.mgmt_port), source="127.0.0.3", prefix=v2)
    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
        http(hrelay.port, "/api/whoami", "remote", "secret")
    wait_until(lambda: b.log_text().count("PROXY header from an untrusted peer") >= 2, 10, "refusal logged")
    # a plain client from the same address still works: only the header is refused
    plain = relays(("127.0.0.1", b.port), source="127.0.0.3")
    remote(plain.port).close()


def test_proxy_v2_before_tls_on_the_amqps_port(tmp_path: Path, relays: Callable[..., Relay]) -> None:
    pki = make_pki(tmp_path / "pki")
    tls_port = free_port()
    b = SkredProcess(tmp_path / f"data-{uuid.uuid4().hex[:6]}",
                     tls_args(pki, "--amqp-tls-port", str(tls_port), "--amqp-trusted-proxies", "127.0.0.2"))
    try:
        b.start()
        add_remote_user(b)
        relay = relays(("127.0.0.1", tls_port), source="127.0.0.2", prefix=v2)
        ctx = pki.client_context()
        conn = pika.BlockingConnection(pika.ConnectionParameters(
            "localhost", relay.port, credentials=pika.PlainCredentials("remote", "secret"),
            ssl_options=pika.SSLOptions(ctx, "localhost"), socket_timeout=5, connection_attempts=1))
        try:
            (entry,) = http(b.mgmt_port, "/api/connections", "guest", "guest")[1]
            assert (entry["peer_host"], entry["peer_port"]) == REAL_CLIENT and entry["ssl"] is True
        finally:
            conn.close()
    finally:
        b.close()


def test_slow_partial_header_does_not_block_others(broker_factory: Callable[..., SkredProcess]) -> None:
    b = broker_factory(["--amqp-trusted-proxies", "127.0.0.1"])
    with socket.create_connection(("127.0.0.1", b.port), timeout=5) as s:
        s.sendall(proxy.V2_SIGNATURE[:5])  # and nothing more
        conn = pika.BlockingConnection(pika.ConnectionParameters(
            "127.0.0.1", b.port, socket_timeout=5, connection_attempts=1))
        conn.close()
