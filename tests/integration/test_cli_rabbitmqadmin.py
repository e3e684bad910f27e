"""``/cli/rabbitmqadmin``: fetched as users fetch it (no login, ``curl -O``), then run the way
setup scripts and Dockerfiles run it, against the same broker."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from ._support import SkredProcess, is_external, unique
from .test_mgmt_api import Api, q
from .test_mgmt_api import mb as mb  # noqa: F401 - a module's broker with the management API

pytestmark = pytest.mark.skipif(is_external(), reason="needs Skred's management API on a known port")


def test_served_script_runs_the_usual_commands(mb: SkredProcess, tmp_path: Path) -> None:
    with urllib.request.urlopen(f"http://127.0.0.1:{mb.mgmt_port}/cli/rabbitmqadmin", timeout=10) as resp:
        assert resp.status == 200
        script = resp.read()
    assert script.startswith(b"#!/usr/bin/env python3")
    path = tmp_path / "rabbitmqadmin"
    path.write_bytes(script)

    def run(*args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
        res = subprocess.run([sys.executable, str(path), "-H", "127.0.0.1", "-P", str(mb.mgmt_port), *args],
                             capture_output=True, text=True, timeout=60)
        assert (res.returncode == 0) == ok and "Traceback" not in res.stderr, (args, res.stdout, res.stderr)
        return res

    qn, xn, vh = unique("q"), unique("x"), unique("vh")
    run("declare", "queue", f"name={qn}", "durable=true", 'arguments={"x-max-length": 10}')
    run("declare", "exchange", f"name={xn}", "type=topic")
    run("declare", "binding", f"source={xn}", f"destination={qn}", "routing_key=a.#")
    assert "Message published" in run("publish", f"exchange={xn}", "routing_key=a.b", "payload=hello").stdout
    got = json.loads(run("-f", "raw_json", "get", f"queue={qn}", "ackmode=ack_requeue_false").stdout)
    assert [m["payload"] for m in got] == ["hello"]
    listed = run("-f", "tsv", "list", "queues", "name", "durable").stdout.splitlines()
    assert listed[0] == "name\tdurable" and f"{qn}\tTrue" in listed
    assert qn in run("list", "queues").stdout  # the table format
    run("declare", "vhost", f"name={vh}")
    run("declare", "permission", f"vhost={vh}", "user=guest", "configure=.*", "write=.*", "read=.*")
    run("-V", vh, "declare", "queue", "name=inside")
    export = tmp_path / "defs.json"
    run("export", str(export))
    doc = json.loads(export.read_text())
    assert {(x["vhost"], x["name"]) for x in doc["queues"]} >= {("/", qn), (vh, "inside")}
    run("delete", "queue", f"name={qn}")
    run("-V", vh, "delete", "queue", "name=inside")
    run("import", str(export))
    api = Api(mb.mgmt_port)
    assert api.get(f"/api/queues/%2F/{q(qn)}")["arguments"] == {"x-max-length": 10}
    assert api.get(f"/api/queues/{q(vh)}/inside")["name"] == "inside"
    run("purge", "queue", f"name={qn}")
    run("delete", "binding", f"source={xn}", f"destination={qn}", "properties_key=a.%23")
    assert api.get(f"/api/queues/%2F/{q(qn)}/bindings")[1:] == []  # only the default exchange's
    run("delete", "exchange", f"name={xn}")
    run("delete", "vhost", f"name={vh}")
    run("delete", "queue", f"name={qn}")
    assert "Not found" in run("delete", "parameter", "component=shovel", "name=x", ok=False).stderr
    assert "Access refused" in run("-u", "guest", "-p", "wrong", "list", "users", ok=False).stderr
    assert "unknown command" in run("frobnicate", ok=False).stderr
