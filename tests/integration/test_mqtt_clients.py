"""Real MQTT clients against Skred: mosquitto_pub/mosquitto_sub, aiomqtt, MQTT.js and a browser.

Theory of operation: one Skred per module (``mqb``: plain MQTT, MQTTS with a test CA, the
management port for WebSocket), and the session's 3-node cluster for what is durable (a persistent
session and a retained message through a follower). Each client is the real program or library a
user runs: Debian's ``mosquitto-clients`` (3.1.1 and 5, QoS 0/1/2, retained, TLS), aiomqtt (MQTT 5
with properties, request/response with an AMQP service), MQTT.js under Node over TCP and over
WebSocket, and a headless Chromium page running MQTT.js and ``@cloudamqp/amqp-client`` over
WebSocket beside pika. Waits are readiness signals (mosquitto_sub's ``-d`` SUBACK line, the page's
``results.ready``) under deadlines, never sleeps. The JavaScript packages come from the committed
``js/package.json`` and lockfile (``npm ci``, run by .ci/run, or here once when they are missing);
Debian's ``mosquitto-clients`` is installed by .ci/run.
"""

from __future__ import annotations

import asyncio
import functools
import http.server
import json
import os
import queue
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pika
import pytest

from ._support import SkredProcess, connect, free_port, is_external, unique, wait_until
from ._tls import PKI, make_pki, tls_args
from .test_features_extra import wait_http
from .test_web_ui import WAIT, browser  # noqa: F401 - the module-scoped Chromium fixture

pytestmark = pytest.mark.skipif(is_external(), reason="starts its own broker")

JS = Path(__file__).parent / "js"
DEADLINE = 20.0  # seconds for one client's whole exchange; the machine may be loaded


def topic(prefix: str) -> str:
    """A unique topic level without dots (MQTT's '.' is '/' on the AMQP side)."""
    return unique(prefix).replace(".", "-")


def need(tool: str) -> str:
    """The tool's path; a missing one skips the test with the reason, and fails it in CI (.ci/run
    installs them all, so CI never passes by skipping)."""
    path = shutil.which(tool)
    if path is None:
        why = f"{tool} is missing (Debian mosquitto-clients, npm; .ci/run installs them)"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    return path


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    return make_pki(tmp_path_factory.mktemp("mqtt-clients-pki"))


@pytest.fixture(scope="module")
def mqb(tmp_path_factory: pytest.TempPathFactory, pki: PKI) -> Iterator[SkredProcess]:
    """The module's broker: MQTT, MQTTS (``tls_port``) and WebSocket on the management port."""
    tls_port = free_port()
    b = SkredProcess(tmp_path_factory.mktemp("mqtt-clients") / "data",
                     tls_args(pki, "--mqtt-tls-port", str(tls_port), "--amqp-tls-port", "-1",
                              "--mgmt-tls-port", "-1"))
    b.tls_port = tls_port  # type: ignore[attr-defined]
    b.start()
    try:
        wait_http(b)
        yield b
    finally:
        b.close()


@pytest.fixture(scope="session")
def node_modules() -> Path:
    """MQTT.js and amqp-client from the committed lockfile (``npm ci`` once if .ci/run did not)."""
    if not (JS / "node_modules" / "mqtt").is_dir():
        subprocess.run([need("npm"), "ci", "--no-audit", "--no-fund"], cwd=JS, check=True, timeout=300,
                       stdout=subprocess.DEVNULL)
    return JS / "node_modules"


# ------------------------------------------------------------------ mosquitto clients

def mosq(tool: str, host: str, port: int, *args: str) -> list[str]:
    return [need(tool), "-h", host, "-p", str(port), "-u", "guest", "-P", "guest", *args]


class Sub:
    """A running mosquitto_sub: started, then waited on until its SUBACK (``-d`` prints it);
    ``take`` reads the messages it printed (``MSG retained qos topic payload``)."""

    def __init__(self, argv: list[str]) -> None:
        # stdbuf: mosquitto_sub's stdout is a pipe here, which stdio would buffer until exit
        self.p = subprocess.Popen([need("stdbuf"), "-oL", *argv, "-d", "-F", "MSG %r %q %t %p"],
                                  stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.log: list[str] = []
        self.early: list[tuple[str, ...]] = []  # a resumed session's messages may precede SUBACK
        threading.Thread(target=self._read, daemon=True).start()
        self._until(lambda line: "SUBACK" in line or self._early(line), "SUBACK")

    def _early(self, line: str) -> bool:
        if line.startswith("MSG "):
            self.early.append(tuple(line.split(" ", 4)[1:]))
        return False

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def _until(self, pred: Any, what: str, timeout: float = DEADLINE) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                self.p.kill()
                raise AssertionError(f"mosquitto_sub: no {what} in {timeout}s; printed {self.log}") from None
            if line is None:
                if self.early and what == "SUBACK":
                    self.lines.put(None)
                    return ""
                raise AssertionError(f"mosquitto_sub ended before {what}; it printed {self.log}")
            self.log.append(line)
            if pred(line):
                return line

    def take(self, n: int) -> list[tuple[str, ...]]:
        got, self.early = self.early[:n], self.early[n:]
        return got + [tuple(self._until(lambda line: line.startswith("MSG "), "message").split(" ", 4)[1:])
                      for _ in range(n - len(got))]

    def finish(self) -> list[tuple[str, ...]]:
        """Wait for the program to exit by itself (-C, -E, --retained-only); what else it printed."""
        assert self.p.wait(DEADLINE) == 0, self.log
        rest, self.early = self.early, []
        while (line := self.lines.get(timeout=DEADLINE)) is not None:
            self.log.append(line)
            if line.startswith("MSG "):
                rest.append(tuple(line.split(" ", 4)[1:]))
        return rest


def pub(host: str, port: int, *args: str) -> None:
    out = subprocess.run(mosq("mosquitto_pub", host, port, *args), capture_output=True, text=True,
                         timeout=DEADLINE)
    assert out.returncode == 0, out


@pytest.mark.parametrize("version", ["mqttv311", "mqttv5"])
def test_mosquitto_clients_qos_levels(mqb: SkredProcess, version: str) -> None:
    top = topic("mq")
    sub = Sub(mosq("mosquitto_sub", mqb.host, mqb.mqtt_port, "-V", version, "-q", "2", "-t", f"{top}/#",
                   "-C", "3"))
    for qos in (0, 1, 2):
        pub(mqb.host, mqb.mqtt_port, "-V", version, "-q", str(qos), "-t", f"{top}/q{qos}", "-m", f"m{qos}")
    got = sorted(sub.take(3))
    # a QoS 2 subscription is granted QoS 1 (docs/mqtt.md), so the QoS 2 message arrives at QoS 1
    assert got == [("0", "0", f"{top}/q0", "m0"), ("0", "1", f"{top}/q1", "m1"),
                   ("0", "1", f"{top}/q2", "m2")]
    assert sub.finish() == []


def test_mosquitto_clients_retained_wildcard_and_clear(mqb: SkredProcess) -> None:
    top = topic("ret")
    h, p = mqb.host, mqb.mqtt_port
    pub(h, p, "-q", "1", "-r", "-t", f"{top}/a/temp", "-m", "21.5")
    pub(h, p, "-V", "mqttv5", "-q", "1", "-r", "-t", f"{top}/b/temp", "-m", "19")
    sub = Sub(mosq("mosquitto_sub", h, p, "-q", "1", "-t", f"{top}/+/temp", "-C", "2"))
    assert sorted(sub.take(2)) == [("1", "1", f"{top}/a/temp", "21.5"), ("1", "1", f"{top}/b/temp", "19")]
    sub.finish()
    pub(h, p, "-q", "1", "-r", "-n", "-t", f"{top}/a/temp")  # an empty retained publish clears
    # --retained-only prints retained messages and exits at the first live one, sent after SUBACK
    sub = Sub(mosq("mosquitto_sub", h, p, "-V", "mqttv5", "-q", "1", "-t", f"{top}/#", "--retained-only"))
    assert sub.take(1) == [("1", "1", f"{top}/b/temp", "19")]
    pub(h, p, "-q", "1", "-t", f"{top}/live", "-m", "x")
    assert sub.finish() == []


def test_mosquitto_clients_over_tls(mqb: SkredProcess, pki: PKI) -> None:
    top = topic("tls")
    port = mqb.tls_port  # type: ignore[attr-defined]
    tls = ["--cafile", str(pki.ca.cert_path)]
    sub = Sub(mosq("mosquitto_sub", "localhost", port, *tls, "-V", "mqttv5", "-q", "1", "-t", f"{top}/#",
                   "-C", "1"))
    pub("localhost", port, *tls, "-q", "1", "-t", f"{top}/x", "-m", "over tls")
    assert sub.take(1) == [("0", "1", f"{top}/x", "over tls")]
    sub.finish()
    # a client that does not trust the broker's CA gets no connection
    bad = subprocess.run(mosq("mosquitto_pub", "localhost", port, "--cafile", str(pki.server.cert),
                              "-t", "x", "-m", "x"), capture_output=True, text=True, timeout=DEADLINE)
    assert bad.returncode != 0


def test_a_burst_of_deliveries_leaves_in_few_writes(mqb: SkredProcess) -> None:
    """1,000 QoS 0 messages published in one burst reach their subscriber in a few socket writes
    (the broker's write system calls, /proc/PID/io), not one per message: that held a subscriber
    to about a thousand messages a second on a loaded machine (benchmarks/mqtt.py)."""
    from broker.mqtt import packets as P

    from .test_mqtt import Raw, cid, login

    def writes() -> int:
        assert mqb.pid is not None
        return int(re.search(r"syscw: (\d+)", Path(f"/proc/{mqb.pid}/io").read_text()).group(1))  # type: ignore[union-attr]

    top = topic("burst")
    sub, pub = Raw(mqb.host, mqb.mqtt_port, login(cid())), Raw(mqb.host, mqb.mqtt_port, login(cid()))
    try:
        assert sub.connack() == (0, 0) and pub.connack() == (0, 0)
        sub.s.sendall(P.encode_subscribe(P.Subscribe(1, ((f"{top}/#", 0),))))
        assert sub.read() is not None  # SUBACK
        before = writes()
        pub.s.sendall(P.encode_publish(f"{top}/x", b"m", 0, False, False, 0) * 1000)
        for _ in range(1000):
            pkt = sub.read()
            assert pkt is not None and pkt[0] == P.PUBLISH
        assert writes() - before < 100
    finally:
        sub.close()
        pub.close()


# ------------------------------------------------------------------ durable state, cluster modes

def mqtt_endpoint(mode: str, mqb: SkredProcess, request: pytest.FixtureRequest) -> tuple[str, int, str]:
    if mode == "single":
        return mqb.host, mqb.mqtt_port, mqb.url
    node = request.getfixturevalue("session_cluster").target(mode).node
    return node.ip, node.mqtt_port, node.url


@pytest.mark.parametrize("mode", ["single", "leader", "follower"])
def test_mosquitto_persistent_session_and_retained(mqb: SkredProcess, mode: str,
                                                   request: pytest.FixtureRequest) -> None:
    """A persistent session's QoS 1 messages and a retained message wait for the client, on one
    node, on a cluster's leader and through a follower (published through the other node)."""
    h, p, url = mqtt_endpoint(mode, mqb, request)
    if mode == "single":
        ph, pp = h, p
    else:
        cluster = request.getfixturevalue("session_cluster")
        other = cluster.target("leader" if mode == "follower" else "follower").node
        ph, pp = other.ip, other.mqtt_port
    top, client = topic("ps"), topic("mosq-ps")
    session = ["-c", "-i", client, "-q", "1", "-t", f"{top}/#"]
    Sub(mosq("mosquitto_sub", h, p, *session, "-E")).finish()  # subscribe, then go away
    for i in range(3):
        pub(ph, pp, "-q", "1", "-t", f"{top}/m", "-m", str(i))
    pub(ph, pp, "-q", "1", "-r", "-t", f"{top}/state", "-m", "on")
    sub = Sub(mosq("mosquitto_sub", h, p, *session, "-C", "4"))
    got = sub.take(4)
    sub.finish()
    assert sorted(m[3] for m in got if m[2] == f"{top}/m") == ["0", "1", "2"], got
    assert [m[3] for m in got if m[2] == f"{top}/state"] == ["on"], got
    pub(ph, pp, "-q", "1", "-r", "-n", "-t", f"{top}/state")
    Sub(mosq("mosquitto_sub", h, p, "-i", client, "-t", f"{top}/#", "-E")).finish()  # clean: session gone
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        ch = conn.channel()
        with pytest.raises(pika.exceptions.ChannelClosedByBroker):
            ch.queue_declare(f"mqtt-subscription-{client}qos1", passive=True)
    finally:
        if conn.is_open:
            conn.close()


# ------------------------------------------------------------------ aiomqtt (MQTT 5)

def test_aiomqtt_v5_request_response_with_an_amqp_service(mqb: SkredProcess) -> None:
    """aiomqtt (MQTT 5) calls an AMQP service: the response topic and correlation data become
    reply_to and correlation_id, the service's answer comes back with them, and the content type
    and user properties cross both ways."""
    aiomqtt = pytest.importorskip("aiomqtt")  # [test] extra
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    top = topic("rpc")
    conn = connect(mqb)
    ch = conn.channel()
    service = ch.queue_declare("", exclusive=True).method.queue
    ch.queue_bind(service, "amq.topic", f"{top}.request")

    def serve() -> Any:
        deadline = time.monotonic() + DEADLINE
        while time.monotonic() < deadline:
            m, props, body = ch.basic_get(service, auto_ack=True)
            if m is not None:
                ch.basic_publish("amq.topic", props.reply_to, body.upper(), pika.BasicProperties(
                    correlation_id=props.correlation_id, content_type="text/plain",
                    headers={"served-by": "pika"}))
                return props
            conn.process_data_events(0.02)
        raise AssertionError("the request never reached the AMQP service")

    async def call() -> tuple[Any, Any]:
        async with aiomqtt.Client(mqb.host, mqb.mqtt_port, username="guest", password="guest",
                                  identifier=unique("aiomqtt"), protocol=aiomqtt.ProtocolVersion.V5) as c:
            await c.subscribe(f"{top}/reply", qos=1)
            props = Properties(PacketTypes.PUBLISH)
            props.ResponseTopic = f"{top}/reply"
            props.CorrelationData = b"call-1"
            props.ContentType = "text/plain"
            props.UserProperty = [("from", "aiomqtt")]
            await c.publish(f"{top}/request", b"ping", qos=1, properties=props)
            request_props = await asyncio.to_thread(serve)
            async for msg in c.messages:
                return request_props, msg
        raise AssertionError("no reply")

    try:
        request_props, reply = asyncio.run(asyncio.wait_for(call(), DEADLINE))
    finally:
        conn.close()
    assert request_props.reply_to == f"{top}.reply" and request_props.correlation_id == "call-1"
    assert request_props.content_type == "text/plain"
    assert (request_props.headers or {}).get("from") == "aiomqtt"
    assert str(reply.topic) == f"{top}/reply" and reply.payload == b"PING" and reply.qos == 0
    assert reply.properties.CorrelationData == b"call-1"
    assert reply.properties.ContentType == "text/plain"
    assert ("served-by", "pika") in reply.properties.UserProperty


# ------------------------------------------------------------------ MQTT.js under Node

@pytest.mark.parametrize("transport,version", [("tcp", 4), ("tcp", 5), ("ws", 4), ("ws", 5)])
def test_mqttjs_under_node(mqb: SkredProcess, node_modules: Path, transport: str, version: int) -> None:
    top = topic("js")
    url = (f"mqtt://{mqb.host}:{mqb.mqtt_port}" if transport == "tcp"
           else f"ws://{mqb.host}:{mqb.mgmt_port}/mqtt")
    conn = connect(mqb)
    ch = conn.channel()
    q = ch.queue_declare("", exclusive=True).method.queue
    ch.queue_bind(q, "amq.topic", f"{top}.#")  # an AMQP queue sees what MQTT.js publishes
    try:
        out = subprocess.run([need("node"), str(JS / "mqttjs_roundtrip.mjs"), url, str(version), top],
                             capture_output=True, text=True, timeout=DEADLINE, cwd=JS)
        assert out.returncode == 0, (out.stdout, out.stderr)
        report = json.loads(out.stdout.splitlines()[-1])
        got = sorted((m["topic"], m["payload"], m["qos"]) for m in report["got"])
        assert got == [(f"{top}/q0", "m0", 0), (f"{top}/q1", "m1", 1), (f"{top}/q2", "m2", 1)]
        amqp = []
        for _ in range(3):
            m, props, body = ch.basic_get(q, auto_ack=True)
            assert m is not None
            amqp.append((m.routing_key, body, props.content_type if version == 5 else None))
        want_ct = "text/plain" if version == 5 else None
        assert sorted(amqp) == [(f"{top}.q{i}", f"m{i}".encode(), want_ct) for i in range(3)]
    finally:
        conn.close()


# ------------------------------------------------------------------ a real browser page

@pytest.fixture(scope="module")
def page_server(node_modules: Path) -> Iterator[int]:
    """Serves js/ (the page and its packages) on a free loopback port."""
    handler = functools.partial(_Quiet, directory=str(JS))
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield int(srv.server_address[1])
    finally:
        srv.shutdown()
        srv.server_close()


class _Quiet(http.server.SimpleHTTPRequestHandler):
    extensions_map = {**http.server.SimpleHTTPRequestHandler.extensions_map, ".mjs": "text/javascript"}

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass


def test_browser_page_mqttjs_and_amqp_client_with_pika(mqb: SkredProcess, page_server: int,
                                                       browser: Any) -> None:  # noqa: F811
    """Chromium runs MQTT.js and @cloudamqp/amqp-client over WebSocket; pika on AMQP exchanges
    messages with both, and the page's two clients reach each other through amq.topic."""
    from selenium.webdriver.support.ui import WebDriverWait

    top = topic("page")
    conn = connect(mqb)
    ch = conn.channel()
    q = ch.queue_declare("", exclusive=True).method.queue
    ch.queue_bind(q, "amq.topic", f"from-browser.{top}.*")
    try:
        browser.get(f"http://127.0.0.1:{page_server}/page.html?port={mqb.mgmt_port}&id={top}")

        def results(_d: Any = None) -> Any:
            return browser.execute_script("return window.results")

        def ready(_d: Any) -> bool:
            r = results()
            assert r is None or not r["errors"], r["errors"]
            return bool(r and r["ready"] and r["published"])

        WebDriverWait(browser, WAIT).until(ready, "the page's clients subscribed and published")
        ch.basic_publish("amq.topic", f"to-browser.{top}.from-pika", b"pika to mqtt")
        ch.basic_publish("amq.topic", f"to-browser-amqp.{top}", b"pika to amqp-client")
        WebDriverWait(browser, WAIT).until(lambda _d: len(results()["mqtt"]) >= 2 and results()["amqp"],
                                           "the page received")
        r = results()
        assert sorted(map(tuple, r["mqtt"])) == [(f"to-browser/{top}/from-amqp-client", "amqp to mqtt", 0),
                                                 (f"to-browser/{top}/from-pika", "pika to mqtt", 0)]
        assert r["amqp"] == [[f"to-browser-amqp.{top}", "pika to amqp-client"]]
        got = []
        wait_until(lambda: _drain(ch, q, got) >= 2, DEADLINE, "the page's publishes in the AMQP queue")
        assert sorted(got) == [(f"from-browser.{top}.amqp", b"hello from amqp-client"),
                               (f"from-browser.{top}.mqtt", b"hello from MQTT.js")]
        assert r["errors"] == []
    finally:
        browser.get("about:blank")  # closes the page's connections
        conn.close()


def _drain(ch: Any, q: str, into: list[tuple[str, bytes]]) -> int:
    m, _, body = ch.basic_get(q, auto_ack=True)
    if m is not None:
        into.append((m.routing_key, body))
    return len(into)

