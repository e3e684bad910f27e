"""A big definitions import on a cluster leader keeps the leader's etcd lease.

Theory of operation: a real etcd and three ``skred --clustering`` processes (``test_cluster``)
with the tests' short lease (``TTL``, 2 s). The leader is sent one document of ``QUEUES`` durable
queues in a fresh vhost, each bound to ``amq.direct``: enough that applying it in one turn of
the leader's event loop takes longer than the lease (it did: the keep-alive could not run, the
leader stepped down mid-import, a follower took over without the import and the client's
request ended with the connection closed). The import must answer success, the leader must
still be the leader with no step-down in its log, and every queue (its directory and ``.queue``
name file, replicated) must be on every follower. 1,000 queues failed on the old code once in
two runs on a loaded machine; 2,000 (``QUEUES``) failed every time (the leader stepped down and
the request got no answer), and takes about 15 s here with the fix.
"""

from __future__ import annotations

import base64
import json
import urllib.request

import pytest

from broker.store.paths import queue_dir, vhost_dir

from .test_cluster import Cluster, cluster, start_cluster, wait_for  # noqa: F401 (fixture)

pytestmark = pytest.mark.timeout(120)

QUEUES = 2000
VHOST = "lease-import"
AUTH = "Basic " + base64.b64encode(b"guest:guest").decode()


def _document() -> dict[str, object]:
    names = [f"lease-{i:05d}" for i in range(QUEUES)]
    return {
        "vhosts": [{"name": VHOST}],
        "permissions": [{"user": "guest", "vhost": VHOST, "configure": ".*", "write": ".*", "read": ".*"}],
        "queues": [{"name": n, "vhost": VHOST, "durable": True, "auto_delete": False, "arguments": {}}
                   for n in names],
        "bindings": [{"source": "amq.direct", "vhost": VHOST, "destination": n, "destination_type": "queue",
                      "routing_key": n, "arguments": {}} for n in names],
    }


def _missing_on(data_dir: object, names: list[str]) -> int:
    root = vhost_dir(data_dir, VHOST)  # type: ignore[arg-type]
    return sum(not (queue_dir(root, n) / ".queue").is_file() for n in names)


def test_big_import_keeps_the_leaders_lease(cluster: Cluster) -> None:  # noqa: F811 (fixture)
    c = cluster
    leader, followers = start_cluster(c)
    doc = _document()
    req = urllib.request.Request(f"http://{leader.ip}:{leader.mgmt_port}/api/definitions",
                                 data=json.dumps(doc).encode(), method="POST",
                                 headers={"Authorization": AUTH, "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            status = resp.status
    except Exception as exc:  # the connection closed by a leader stepping down
        raise AssertionError(f"import failed: {exc!r}\n{c.diag()}") from None
    assert status == 204, status
    assert c.leader() is leader, c.diag()
    assert "stepping down" not in leader.log_text(), leader.log_tail()
    names = [str(q["name"]) for q in doc["queues"]]  # type: ignore[attr-defined, union-attr]
    for f in followers:
        wait_for(lambda f=f: _missing_on(f.data_dir, names) == 0, 30,
                 f"every imported queue on {f.name}")
    assert "stepping down" not in leader.log_text(), leader.log_tail()
