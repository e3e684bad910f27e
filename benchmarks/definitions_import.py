#!/usr/bin/env python3
"""How long ``POST /api/definitions`` takes to import many queues.

One private ``skred`` process on free ports and a temp data dir; a definitions document with
``--queues`` durable queues (each bound to ``amq.direct`` when ``--bind``) is posted once per
``--runs`` to a fresh vhost, and the wall time of the request and the broker's CPU time for it
(user + system, which a shared machine distorts less) are printed. With ``--py-spy FILE`` the
broker runs under ``py-spy record`` (``pip install py-spy``) and the profile is written as a
flame graph (SVG) or, with ``--py-spy-format speedscope``, as speedscope JSON.

    python benchmarks/definitions_import.py --queues 10000
    python benchmarks/definitions_import.py --queues 10000 --py-spy /tmp/import.svg
    python benchmarks/definitions_import.py --queues 10000 --cluster

With ``--cluster`` the broker is the leader of a three-node cluster (a real etcd and three
``skred --clustering`` processes, as ``tests/integration/test_cluster.py`` starts them) and the
document is posted to the leader: its definitions log and queue directories replicate to the
followers while it applies the import.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from tests.integration._support import SkredProcess, wait_until  # noqa: E402
from tests.integration.test_cluster import Cluster, start_cluster  # noqa: E402

AUTH = "Basic " + base64.b64encode(b"guest:guest").decode()
DEADLINE = 600.0  # seconds one import may take before the run is given up


def document(vhost: str, queues: int, bind: bool) -> dict[str, object]:
    names = [f"defs-bench-{i:06d}" for i in range(queues)]
    return {
        "vhosts": [{"name": vhost}],
        "queues": [{"name": n, "vhost": vhost, "durable": True, "auto_delete": False, "arguments": {}}
                   for n in names],
        "bindings": [{"source": "amq.direct", "vhost": vhost, "destination": n, "destination_type": "queue",
                      "routing_key": n, "arguments": {}} for n in names] if bind else [],
    }


def post(host: str, port: int, doc: dict[str, object]) -> float:
    req = urllib.request.Request(f"http://{host}:{port}/api/definitions", data=json.dumps(doc).encode(),
                                 method="POST", headers={"Authorization": AUTH,
                                                         "Content-Type": "application/json"})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=DEADLINE) as resp:
            assert resp.status in (200, 201, 204), resp.status
    except urllib.error.HTTPError as exc:
        raise SystemExit(f"import refused: {exc.code} {exc.read().decode(errors='replace')}") from None
    return time.perf_counter() - t0


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def http_ready(host: str, port: int) -> bool:
    try:
        req = urllib.request.Request(f"http://{host}:{port}/api/overview", headers={"Authorization": AUTH})
        with urllib.request.urlopen(req, timeout=2):
            return True
    except OSError:
        return False


class Target:
    """The node the document is posted to: a single node, or a cluster's leader."""

    def __init__(self, tmp: Path, cluster: bool, ttl: int) -> None:
        self.cluster: Cluster | None = None
        self.single: SkredProcess | None = None
        if cluster:
            self.cluster = Cluster(tmp, ttl=ttl)
            leader, _ = start_cluster(self.cluster)
            assert leader.proc is not None
            self.pid, self.port, self.host = leader.proc.pid, leader.mgmt_port, leader.ip
        else:
            self.single = SkredProcess(tmp / "data", ["--log-level", "warning", "--workers", "1"])
            self.single.start()
            assert self.single.pid is not None
            self.pid, self.port, self.host = self.single.pid, self.single.mgmt_port, "127.0.0.1"

    def diag(self) -> str:
        if self.cluster is not None:
            return self.cluster.diag()
        assert self.single is not None
        return self.single.log_tail()

    def close(self) -> None:
        if self.cluster is not None:
            self.cluster.close()
        if self.single is not None:
            self.single.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--queues", type=int, default=10000)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--bind", action="store_true", help="bind every queue to amq.direct too")
    ap.add_argument("--cluster", action="store_true", help="post to the leader of a 3-node cluster")
    ap.add_argument("--lease-ttl", type=int, default=10, help="etcd lease TTL, s")
    ap.add_argument("--py-spy", type=Path, default=None, help="profile the broker into this file")
    ap.add_argument("--py-spy-format", default="flamegraph", choices=("flamegraph", "speedscope", "raw"))
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="skred-defs-") as tmp:
        spy: subprocess.Popen[bytes] | None = None
        b = Target(Path(tmp), args.cluster, args.lease_ttl)
        try:
            wait_until(lambda: http_ready(b.host, b.port), 20, "management HTTP listener")
            if args.py_spy is not None:
                exe = shutil.which("py-spy")
                assert exe, "py-spy is not installed (pip install py-spy)"
                spy = subprocess.Popen([exe, "record", "-p", str(b.pid), "-o", str(args.py_spy),
                                        "-f", args.py_spy_format, "-r", "200"], start_new_session=True)
                time.sleep(1.0)  # py-spy attaches; nothing to poll for
            for run in range(min(args.runs, 20)):
                doc = document(f"defs-bench-{run}", args.queues, args.bind)
                cpu0 = cpu_seconds(b.pid)
                try:
                    took = post(b.host, b.port, doc)
                except OSError:
                    print(b.diag(), file=sys.stderr)
                    raise
                cpu = cpu_seconds(b.pid) - cpu0
                print(f"run {run}: {args.queues} queues{' + bindings' if args.bind else ''}: "
                      f"{took:.2f} s wall, {cpu:.2f} s broker CPU", flush=True)
        finally:
            if spy is not None:
                spy.send_signal(2)  # py-spy writes its file on SIGINT
                try:
                    spy.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    spy.kill()
            b.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
