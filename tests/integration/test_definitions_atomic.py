"""A definitions import is all or nothing across kill -9 (marker ``chaos``).

Theory of operation: one large document (a new vhost, users with permissions, a policy,
exchanges, 300 queues and as many bindings; ``SKRED_DEFS_KILL_QUEUES=3000`` makes it the issue's
size) is posted to ``POST /api/definitions`` of a fresh broker, which is killed with SIGKILL at
a random moment: in the first trial within half a second of the request (while the document is
written down, the vhost and the users are made), in every other one when the import's records
in the definitions log (its exchanges, queues, bindings) reach a random share of the document's
(trial i of n in its own slice, so the kills spread over the import; a full import takes
seconds; the queue directories are all made, off the event loop, before the first queue's
declare). The broker is restarted on the same data dir and what of the document exists is
counted: the vhost, users, permissions, the policy, exchanges, queues and bindings. It must be
all of it (the import was written down before it was applied, and the restart completed it)
or none of it (the kill came before it was written down), never a prefix; each trial's moment
and outcome are in the failure message. ``SKRED_DEFS_KILL_TRIALS`` scales the number of trials
(default 2).

A second test runs the import on a broker whose data dir is a small tmpfs that another process
has nearly filled (``_tmpfs.py``): the import fails half-way for want of space, is answered with
an error, and what it did so far is undone (the definitions log cut back, users and the rest
restored), so nothing of it exists, neither at once nor after space is back and the broker is
killed and restarted.
"""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from broker.store.definitions import read_records
from broker.store.paths import vhost_dir

from ._support import SkredProcess, is_external, wait_until
from ._tmpfs import NEEDS, mount_tmpfs, tmpfs_broker
from .test_names import http

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(300),
              pytest.mark.skipif(is_external(), reason="kills and restarts the broker")]

TRIALS = int(os.environ.get("SKRED_DEFS_KILL_TRIALS", "2"))
N_QUEUES = int(os.environ.get("SKRED_DEFS_KILL_QUEUES", "300"))  # the run had 3,000
N_USERS = 40
N_EXCHANGES = 30
VHOST = "imp-vh"


def document() -> dict[str, Any]:
    queues = [{"name": f"imp-q-{i}", "vhost": "/", "durable": True, "auto_delete": False,
               "arguments": {"x-max-length": 1000 + i}} for i in range(N_QUEUES)]
    exchanges = [{"name": f"imp-x-{i}", "vhost": "/", "type": "topic", "durable": True, "auto_delete": False,
                  "internal": False, "arguments": {}} for i in range(N_EXCHANGES)]
    bindings = [{"source": f"imp-x-{i % N_EXCHANGES}", "vhost": "/", "destination": f"imp-q-{i}",
                 "destination_type": "queue", "routing_key": f"k.{i}", "arguments": {}}
                for i in range(N_QUEUES)]
    users = [{"name": f"imp-user-{i}", "password": f"pw-{i}", "tags": "management"} for i in range(N_USERS)]
    permissions = [{"user": u["name"], "vhost": v, "configure": ".*", "write": ".*", "read": ".*"}
                   for u in users for v in ("/", VHOST)]
    return {"vhosts": [{"name": VHOST}], "users": users, "permissions": permissions,
            "policies": [{"name": "imp-pol", "vhost": "/", "pattern": "^imp-q-", "apply-to": "queues",
                          "priority": 1, "definition": {"max-length-bytes": 10_000_000}}],
            "exchanges": exchanges, "queues": queues, "bindings": bindings}


def what_exists(port: int, host: str = "127.0.0.1") -> dict[str, int]:
    """How much of ``document()`` the broker holds."""
    def get(path: str) -> Any:
        status, body = http(port, "GET", path, None, host)
        assert status == 200, (path, status, body)
        return body

    queues = get("/api/queues/%2F?columns=name")
    bindings = get("/api/bindings/%2F")
    users = get("/api/users")
    permissions = get("/api/permissions")
    return {
        "vhost": int(any(v["name"] == VHOST for v in get("/api/vhosts"))),
        "users": sum(u["name"].startswith("imp-user-") for u in users),
        "permissions": sum(p["user"].startswith("imp-user-") for p in permissions),
        "policies": sum(p["name"] == "imp-pol" for p in get("/api/policies/%2F")),
        "exchanges": sum(x["name"].startswith("imp-x-") for x in get("/api/exchanges/%2F?columns=name")),
        "queues": sum(x["name"].startswith("imp-q-") for x in queues),
        "bindings": sum(b["source"].startswith("imp-x-") for b in bindings),
    }


ALL = {"vhost": 1, "users": N_USERS, "permissions": 2 * N_USERS, "policies": 1, "exchanges": N_EXCHANGES,
       "queues": N_QUEUES, "bindings": N_QUEUES}
NONE = dict.fromkeys(ALL, 0)


def post_in_thread(port: int, doc: dict[str, Any], host: str = "127.0.0.1") -> threading.Thread:
    def run() -> None:
        try:
            http(port, "POST", "/api/definitions", doc, host)
        except OSError:
            pass  # the broker was killed under it: that is the experiment

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _records(b: SkredProcess) -> int:
    """Complete records in the definitions log of vhost '/' (read as an offline tool reads it)."""
    return len(read_records(vhost_dir(b.data_dir, "/") / "definitions.amqp"))


def _kill_moment(b: SkredProcess, trial: int, rng: random.Random, base: int) -> str:
    """Wait for this trial's random moment of the kill: trial 0 within the first half second of
    the request (the intent file, the vhost, the users), every other one when the import's
    records in the definitions log of '/' (its exchanges, queues and bindings, after ``base``)
    reach a random share of the document's, in its own slice of the import."""
    if trial == 0:
        at = rng.uniform(0, 0.5)
        time.sleep(at)  # the random moment of the kill, not a wait for a condition
        return f"{at:.2f} s after the request"
    share = (trial - 1 + rng.random()) / max(1, TRIALS - 1)
    total = N_EXCHANGES + 2 * N_QUEUES
    want = max(1, int(total * share))
    wait_until(lambda: _records(b) - base >= want, 60, f"{want} definitions records of the import")
    return f"at {want} of its {total} definitions records"


def test_import_killed_at_random_moments_is_all_or_nothing(tmp_path: Path) -> None:
    doc = document()
    rng = random.Random()
    seen: list[str] = []
    for i in range(TRIALS):
        b = SkredProcess(tmp_path / f"trial-{i}")
        b.start()
        try:
            base = _records(b)
            t = post_in_thread(b.mgmt_port, doc)
            when = _kill_moment(b, i, rng, base)
            b.kill9()
            t.join(30)
            b.restart()
            got = what_exists(b.mgmt_port)
            seen.append(f"trial {i}: killed {when}: "
                        f"{'all' if got == ALL else 'none' if got == NONE else got}")
            assert got in (ALL, NONE), "\n".join(seen)
        finally:
            b.close()


@NEEDS
def test_import_that_runs_out_of_disk_half_way_changes_nothing(tmp_path: Path) -> None:
    doc = document()
    tmpfs_gen = mount_tmpfs(tmp_path, 12 * 1024 * 1024)
    mnt, holder = next(tmpfs_gen)
    brokers = tmpfs_broker((mnt, holder), tmp_path, ["--free-disk-min", "0", "--segment-size", "256KiB"])
    b = next(brokers)
    try:
        b.run_inside("dd", "if=/dev/zero", f"of={mnt}/filler", "bs=64K")
        b.run_inside("truncate", "-s", "-1M", f"{mnt}/filler")  # room for the intent, not the import
        status, why = http(b.mgmt_port, "POST", "/api/definitions", doc)
        assert status == 503 and isinstance(why, dict) and why.get("error") == "disk_full", (status, why)
        assert what_exists(b.mgmt_port) == NONE
        assert b.alive() and "Traceback" not in b.log_text(), b.log_tail()
        assert b.run_inside("rm", "-f", f"{mnt}/filler").returncode == 0
        b.kill9()
        b.start()
        assert what_exists(b.mgmt_port) == NONE
        status, why = http(b.mgmt_port, "POST", "/api/definitions", doc)  # with room, all of it
        assert status in (201, 204), (status, why)
        assert what_exists(b.mgmt_port) == ALL
    finally:
        brokers.close()
        tmpfs_gen.close()
