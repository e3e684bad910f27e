"""RabbitMQ's own ``rabbitmqadmin`` against a real Skred process.

Every command below works against RabbitMQ 3.10 (the tool ships with Debian's ``rabbitmq-server``
package, which ``.ci/run`` installs); each must exit 0 against Skred with no traceback, and the
objects it declares must be visible through the API afterwards. The commands that fail against
RabbitMQ too (``declare parameter`` without a plugin providing the component) are left out.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pika
import pytest

from ._support import SkredProcess, connect, is_external, unique, wait_until
from .test_mgmt_api import Api, q, start_mgmt_broker

ADMIN = shutil.which("rabbitmqadmin")
pytestmark = [
    pytest.mark.skipif(is_external(), reason="needs Skred's management API on a known port"),
    pytest.mark.skipif(ADMIN is None, reason="rabbitmqadmin (Debian rabbitmq-server) is not installed"),
]

FORMATS = ("table", "tsv", "long", "kvp", "bash", "raw_json", "pretty_json")


@pytest.fixture(scope="module")
def mb(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SkredProcess]:
    b = start_mgmt_broker(tmp_path_factory.mktemp("rmqadmin"))
    yield b
    b.close()


def admin(b: SkredProcess, *args: str, user: str = "guest", password: str = "guest",
          vhost: str | None = None, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    assert ADMIN is not None
    argv = [ADMIN, "-H", "127.0.0.1", "-P", str(b.mgmt_port), "-u", user, "-p", password]
    if vhost is not None:
        argv += ["-V", vhost]
    return subprocess.run(argv + list(args), capture_output=True, text=True, timeout=30,
                          input=stdin)


def ok(b: SkredProcess, *args: str, **kw: str) -> str:
    res = admin(b, *args, **kw)
    assert res.returncode == 0 and "Traceback" not in res.stderr, (args, res.stdout, res.stderr)
    return res.stdout


LISTABLE = ("connections", "channels", "consumers", "exchanges", "queues", "bindings", "users",
            "vhosts", "permissions", "nodes", "parameters", "policies", "operator_policies",
            "vhost_limits")


def test_every_list_and_show_command(mb: SkredProcess) -> None:
    conn = connect(mb)
    try:
        ch = conn.channel()
        qname = unique("lq")
        ch.queue_declare(qname, exclusive=True)
        ch.basic_consume(qname, lambda *a: None)
        for what in LISTABLE:
            ok(mb, "list", what)
            parsed = json.loads(ok(mb, "-f", "raw_json", "list", what))
            assert isinstance(parsed, list), (what, parsed)
        for fmt in FORMATS:
            ok(mb, "-f", fmt, "list", "queues")
        ok(mb, "list", "queues", "name", "messages", "consumers")
        ok(mb, "-S", "name", "-R", "list", "exchanges", "name", "type")
        ok(mb, "list", "queues", vhost="/")
        assert qname in ok(mb, "-f", "raw_json", "list", "consumers")
        for fmt in FORMATS:
            ok(mb, "-f", fmt, "show", "overview")
    finally:
        conn.close()


def test_declare_list_delete_everything(mb: SkredProcess, tmp_path: Path) -> None:
    api = Api(mb.mgmt_port)
    vh, user = unique("vh"), unique("user")
    ok(mb, "declare", "vhost", f"name={vh}", "tracing=false")
    ok(mb, "declare", "user", f"name={user}", "password=pw", "tags=management")
    ok(mb, "declare", "user", f"name={user}2", "password_hash=", "tags=",
       "hashing_algorithm=rabbit_password_hashing_sha256")
    ok(mb, "declare", "permission", f"vhost={vh}", f"user={user}", "configure=.*", "write=.*", "read=.*")
    ok(mb, "declare", "vhost_limit", f"vhost={vh}", "name=max-connections", "value=100")
    ok(mb, "declare", "exchange", "name=ex1", "type=topic", vhost=vh)
    ok(mb, "declare", "exchange", "name=ex2", "type=fanout", "durable=false", "auto_delete=true",
       "internal=false", 'arguments={"alternate-exchange":"amq.fanout"}', vhost=vh)
    ok(mb, "declare", "queue", "name=qc", vhost=vh)
    ok(mb, "declare", "queue", "name=qq", "queue_type=quorum", vhost=vh)
    ok(mb, "declare", "queue", "name=qs", "queue_type=stream", vhost=vh)
    ok(mb, "declare", "queue", "name=qa", "durable=false", 'arguments={"x-max-length":10}', vhost=vh)
    ok(mb, "declare", "binding", "source=ex1", "destination=qc", "routing_key=a.#", vhost=vh)
    ok(mb, "declare", "binding", "source=ex1", "destination=ex2", "destination_type=exchange",
       "routing_key=b", vhost=vh)
    ok(mb, "declare", "policy", "name=p1", "pattern=^qc$", 'definition={"max-length":5}', "priority=1",
       "apply-to=queues", vhost=vh)
    ok(mb, "declare", "operator_policy", "name=op1", "pattern=.*", 'definition={"max-length":1000}',
       "apply-to=queues", vhost=vh)

    queues = {x["name"]: x for x in api.get(f"/api/queues/{q(vh)}")}
    assert queues["qq"]["type"] == "quorum" and queues["qs"]["type"] == "stream"
    assert queues["qc"]["type"] == "classic"
    assert api.get(f"/api/vhost-limits/{q(vh)}")[0]["value"] == {"max-connections": 100}
    for what in ("queues", "exchanges", "bindings", "policies", "operator_policies", "vhost_limits"):
        ok(mb, "list", what, vhost=vh)
    assert "op1" in ok(mb, "list", "operator_policies", vhost=vh)

    # publish / get, every ack mode, payload from stdin and to a file
    ok(mb, "publish", "exchange=ex1", "routing_key=a.x", "payload=hello", vhost=vh)
    ok(mb, "publish", "exchange=ex1", "routing_key=a.y", 'properties={"content_type":"text/plain"}',
       vhost=vh, stdin="from stdin")
    ok(mb, "publish", "routing_key=qc", "payload=aGk=", "payload_encoding=base64", vhost=vh)
    assert "hello" in ok(mb, "get", "queue=qc", "ackmode=ack_requeue_true", vhost=vh)
    assert "hello" in ok(mb, "get", "queue=qc", "count=3", "ackmode=reject_requeue_true", vhost=vh)
    out = tmp_path / "payload.bin"
    ok(mb, "get", "queue=qc", f"payload_file={out}", "ackmode=ack_requeue_false", vhost=vh)
    assert out.read_bytes() == b"hello"
    ok(mb, "get", "queue=qc", "count=5", "ackmode=reject_requeue_false", "encoding=base64", vhost=vh)
    ok(mb, "purge", "queue", "name=qc", vhost=vh)

    # definitions, whole broker and one vhost
    whole, one = tmp_path / "all.json", tmp_path / "one.json"
    ok(mb, "export", str(whole))
    ok(mb, "export", str(one), vhost=vh)
    ok(mb, "import", str(whole))
    ok(mb, "import", str(one), vhost=vh)

    ok(mb, "delete", "binding", "source=ex1", "destination_type=queue", "destination=qc",
       "properties_key=a.%23", vhost=vh)
    ok(mb, "delete", "policy", "name=p1", vhost=vh)
    ok(mb, "delete", "operator_policy", "name=op1", vhost=vh)
    ok(mb, "delete", "vhost_limit", f"vhost={vh}", "name=max-connections")
    for qn in ("qc", "qq", "qs", "qa"):
        ok(mb, "delete", "queue", f"name={qn}", vhost=vh)
    ok(mb, "delete", "exchange", "name=ex2", vhost=vh)
    ok(mb, "delete", "permission", f"vhost={vh}", f"user={user}")
    ok(mb, "delete", "user", f"name={user}")
    ok(mb, "delete", "user", f"name={user}2")
    ok(mb, "delete", "vhost", f"name={vh}")
    assert vh not in {v["name"] for v in api.get("/api/vhosts")}


def test_close_connection(mb: SkredProcess) -> None:
    conn = connect(mb, client_properties={"connection_name": unique("c")})
    try:
        names: list[str] = []

        def listed() -> bool:
            names[:] = [c["name"] for c in json.loads(ok(mb, "-f", "raw_json", "list", "connections"))]
            return bool(names)
        wait_until(listed, 10, "connection listed")
        for name in names:
            ok(mb, "close", "connection", f"name={name}")
        with pytest.raises(pika.exceptions.AMQPError):
            wait_until(lambda: (conn.process_data_events(0.1), False)[1], 10, "connection closed")
    finally:
        if conn.is_open:
            conn.close()


def test_refusal_is_401_access_refused(mb: SkredProcess) -> None:
    """RabbitMQ answers a permission refusal with 401; rabbitmqadmin prints one line for it."""
    user = unique("weak")
    ok(mb, "declare", "user", f"name={user}", "password=pw", "tags=management")
    try:
        for args in (("list", "users"), ("declare", "vhost", "name=nope"),
                     ("declare", "queue", "name=x")):
            res = admin(mb, *args, user=user, password="pw")
            assert res.returncode != 0, args
            assert "Traceback" not in res.stderr and "Access refused" in res.stderr, (args, res.stderr)
    finally:
        ok(mb, "delete", "user", f"name={user}")


def test_delete_missing_parameter_is_not_found(mb: SkredProcess) -> None:
    """As against RabbitMQ: a parameter that does not exist is 404, which rabbitmqadmin prints
    as one 'Not found' line (a 405 made it fail with a traceback)."""
    for component in ("federation-upstream", "shovel"):
        res = admin(mb, "delete", "parameter", f"component={component}", f"name={unique('p')}")
        assert res.returncode != 0
        assert "Traceback" not in res.stderr and "Not found" in res.stderr, res.stderr
