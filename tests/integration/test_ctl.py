"""skredctl against a real Skred process: every command, tables and --json, error messages."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker.ctl import main

from ._support import REPO_ROOT, SkredProcess, free_port, unique
from .test_ctl_lavinmq import Result
from .test_mgmt_api import Api, pytestmark, start_mgmt_broker  # noqa: F401

__all__ = ["pytestmark"]


@pytest.fixture(scope="module")
def mb(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SkredProcess]:
    b = start_mgmt_broker(tmp_path_factory.mktemp("ctl"))
    yield b
    b.close()


def ctl(
    b: SkredProcess | None, *args: str, user: str = "guest", password: str = "guest", url: str | None = None
) -> Result:
    """skredctl's ``main`` in this process (``test_skredctl_as_a_process`` runs the console itself)."""
    base = url or f"http://127.0.0.1:{b.mgmt_port if b else 1}"
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(["--url", base, "-u", user, "-p", password, *args])
        except SystemExit as exc:
            code = int(exc.code or 0)
    return Result(code, out.getvalue(), err.getvalue())


def ok(b: SkredProcess, *args: str) -> str:
    r = ctl(b, *args)
    assert r.returncode == 0, (args, r.stdout, r.stderr)
    return r.stdout


def test_queue_and_user_commands(mb: SkredProcess) -> None:
    qn, user = unique("q"), unique("u")
    assert "declared" in ok(mb, "declare_queue", qn)
    table = ok(mb, "list", "queues")
    assert table.splitlines()[0].split()[:2] == ["vhost", "name"] and qn in table
    rows = json.loads(ok(mb, "--json", "list", "queues", "--vhost", "/"))
    assert any(r["name"] == qn and r["durable"] for r in rows)
    Api(mb.mgmt_port).ok(
        "POST",
        "/api/exchanges/%2F/amq.default/publish",
        {"properties": {}, "routing_key": qn, "payload": "x", "payload_encoding": "string"},
        expect=(200,),
    )
    assert Api(mb.mgmt_port).get(f"/api/queues/%2F/{qn}")["messages"] == 1
    ok(mb, "purge_queue", qn)
    assert Api(mb.mgmt_port).get(f"/api/queues/%2F/{qn}")["messages"] == 0
    ok(mb, "add_user", user, "pw", "--tags", "monitoring")
    ok(mb, "set_permissions", user, ".*", ".*", ".*")
    users = json.loads(ok(mb, "--json", "list", "users"))
    assert any(u["name"] == user and u["tags"] == ["monitoring"] for u in users)
    perms = json.loads(ok(mb, "--json", "list", "permissions"))
    assert {"user": user, "vhost": "/", "configure": ".*", "write": ".*", "read": ".*"} in perms
    assert "node:" in ctl(mb, "status", user=user, password="pw").stdout
    ok(mb, "delete_user", user)
    ok(mb, "delete_queue", qn)
    assert qn not in ok(mb, "list", "queues")
    for what in ("exchanges", "bindings", "connections", "vhosts", "channels", "consumers", "policies"):
        ok(mb, "list", what)
    status = json.loads(ok(mb, "--json", "status"))
    assert status["product_name"] == "Skred"


def test_vhost_and_definitions_commands(mb: SkredProcess, tmp_path: Path) -> None:
    vh, qn = unique("vh"), unique("q")
    ok(mb, "add_vhost", vh)
    ok(mb, "declare_queue", qn, "--vhost", vh)
    out = tmp_path / "defs.json"
    ok(mb, "export_definitions", str(out))
    doc = json.loads(out.read_text())
    assert any(q["name"] == qn and q["vhost"] == vh for q in doc["queues"])
    ok(mb, "delete_vhost", vh)
    assert vh not in ok(mb, "list", "vhosts")
    ok(mb, "import_definitions", str(out))
    assert any(r["name"] == qn for r in json.loads(ok(mb, "--json", "list", "queues", "--vhost", vh)))
    ok(mb, "delete_vhost", vh)


def test_clear_errors(mb: SkredProcess, tmp_path: Path) -> None:
    r = ctl(mb, "list", "queues", password="wrong")
    assert r.returncode == 1 and "authentication failed for user 'guest'" in r.stderr
    assert "Traceback" not in r.stderr
    r = ctl(None, "status", url=f"http://127.0.0.1:{free_port()}")
    assert r.returncode == 2 and "cannot connect to" in r.stderr and "Traceback" not in r.stderr
    r = ctl(mb, "delete_queue", "does-not-exist")
    assert r.returncode == 1 and "not found" in r.stderr
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    r = ctl(mb, "import_definitions", str(bad))
    assert r.returncode == 1 and "cannot read definitions" in r.stderr


def test_skredctl_as_a_process(mb: SkredProcess) -> None:
    """The console entry point itself: exit statuses as a shell sees them, --help per command."""

    def proc(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "broker.ctl", "--url", f"http://127.0.0.1:{mb.mgmt_port}", *args],
            capture_output=True,
            text=True,
            timeout=30,
            cwd=str(REPO_ROOT),
        )

    r = proc("create_queue", "--help")
    assert r.returncode == 0 and "--reject-on-overflow" in r.stdout and "--dead-letter-exchange" in r.stdout
    r = proc("-u", "guest", "-p", "wrong", "stop_app")  # refused, so nothing stopped
    assert r.returncode == 1 and r.stderr.startswith("skredctl: error:")
    r = proc("-f", "json", "list_vhosts", "name")
    assert r.returncode == 0 and {"name": "/"} in json.loads(r.stdout)
    r = proc("-u", "guest", "-p", "wrong", "list_queues")
    assert r.returncode == 1 and "authentication failed" in r.stderr and "Traceback" not in r.stderr
