#!/usr/bin/env python3
"""Issue 28: many idle MQTT clients on one node with several workers, and their memory.

Usage: ``python benchmarks/mqtt_idle.py --clients 50000 --workers 4 --vhosts 4 --procs 4``

Theory of operation: a Skred node (this checkout, ``benchmarks/mqtt.py``'s ``Skred``: free
loopback ports, a private data dir) is started with ``--workers`` workers. ``--vhosts`` vhosts are
declared, chosen so that the shard placement spreads them over the workers evenly
(``broker.shards.placement.worker_of``), with one user holding every permission on each. A node
hands each MQTT connection to the worker owning its vhost (``vhost:user`` username) and the
accepting process closes its copy, so a worker holds only its vhosts' descriptors: 50,000 clients
over 4 vhosts and 4 workers need about 12,500 per worker, under a per-process hard limit of
20,000 open files. The load generator is ``--procs`` child processes of this file (each under
that limit too), each binding its sockets to its own source address of ``--sources`` (127.0.0.2,
127.0.0.3, ...: one source address has only the ephemeral range's ports, about 28,000), opening
its share of clean-session MQTT 3.1.1 clients (keepalive 600, no subscription) ``--at-once`` at a
time, vhosts in turn, within ``--budget`` seconds. Once every generator reports its clients
CONNACKed, the broker's resident memory (VmRSS of the parent and its workers, settled: three
samples 0.5 s apart within 1 %) is read again; the difference from the reading taken with a few
warm clients per vhost, divided by the clients held, is the memory per idle connection (kernel
socket buffers are not in RSS). Then each generator makes one QoS 0 PUBLISH round trip per vhost
between two of its idle clients (the node still serves), and all close.
"""

from __future__ import annotations

import argparse
import asyncio
import compileall
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.mqtt import (  # noqa: E402  (needs the repo root)
    Conn,
    Skred,
    close_all,
    connect_packet,
    publish_packets,
    settled_rss,
    subscribe,
    tree,
    use_uvloop,
    vmrss_kib,
)
from benchmarks.workers import api_put  # noqa: E402
from broker.shards.placement import worker_of  # noqa: E402

USER = PASSWORD = "idlebench"
FILE_LIMIT = 20000  # the hard limit on open files per process on the machine measured
IP_BIND_ADDRESS_NO_PORT = getattr(socket, "IP_BIND_ADDRESS_NO_PORT", 24)  # Linux 4.2


# ------------------------------------------------------------------ a generator process

async def open_one(host: str, port: int, source: str, vhost: str, client_id: str) -> Conn:
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        # the port is picked at connect, for the 4-tuple: a bind to port 0 picks one free for
        # every destination, a search of the ephemeral range that grows with the sockets bound
        # (at 10,000 per address it was the generators' whole CPU, in the kernel)
        sock.setsockopt(socket.SOL_IP, IP_BIND_ADDRESS_NO_PORT, 1)
        sock.bind((source, 0))
        sock.setblocking(False)
        await loop.sock_connect(sock, (host, port))
        _, c = await loop.create_connection(lambda: Conn(), sock=sock)
    except BaseException:
        sock.close()
        raise
    assert c.transport is not None
    c.transport.write(connect_packet(client_id, user=f"{vhost}:{USER}", password=PASSWORD))
    _, rc = await asyncio.wait_for(c.connack, 120)
    if rc != 0:
        raise ConnectionError(f"CONNACK {rc}")
    return c


async def round_trips(conns: list[Conn], vhosts: list[str], prefix: str) -> dict[str, Any]:
    """One QoS 0 PUBLISH per vhost from an idle client to another idle client of that vhost."""
    ok, worst = 0, 0.0
    v = len(vhosts)
    for k in range(min(v, max(0, len(conns) - v))):
        sub, pub = conns[k], conns[k + v]  # clients go round the vhosts: k and k + v share one
        topic = f"idle/check/{prefix}{k}"
        await subscribe(sub, topic, 0)
        t0 = time.perf_counter()
        assert pub.transport is not None
        pub.transport.write(publish_packets(topic, 0, 1)[0])
        deadline = time.monotonic() + 30
        while not sub.received and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # poll interval, bounded by the deadline
        if sub.received:
            ok += 1
            worst = max(worst, time.perf_counter() - t0)
    return {"round_trips": ok, "worst_ms": worst * 1000}


async def generate(args: argparse.Namespace) -> None:
    vhosts = args.vhost_list.split(",")
    conns: list[Conn] = []
    failed, first_error = 0, ""
    t0 = time.perf_counter()
    deadline = time.monotonic() + args.budget
    quarters: list[float] = []  # seconds until each quarter of the clients was connected
    for first in range(0, args.count, args.at_once):
        if time.monotonic() > deadline:
            break
        if first >= (len(quarters) + 1) * args.count / 4:
            quarters.append(round(time.perf_counter() - t0, 1))
        ids = range(first, min(args.count, first + args.at_once))
        got = await asyncio.gather(*(open_one("127.0.0.1", args.port, args.source, vhosts[i % len(vhosts)],
                                              f"{args.prefix}{i}") for i in ids), return_exceptions=True)
        for c in got:
            if isinstance(c, BaseException):
                failed += 1
                first_error = first_error or f"{type(c).__name__}: {c}"
            else:
                conns.append(c)
    live = [c for c in conns if not c.closed]
    took = time.perf_counter() - t0
    print(json.dumps({"connected": len(live), "failed": failed, "dropped": len(conns) - len(live),
                      "seconds": took, "quarters": [*quarters, round(took, 1)], "error": first_error}),
          flush=True)
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):  # the parent's commands
        if line.strip() == "check":
            r = await round_trips(live, vhosts, args.prefix)
            r["still_open"] = sum(not c.closed for c in live)
            print(json.dumps(r), flush=True)
        elif line.strip() == "close":
            break
    close_all(live)
    await loop.run_in_executor(None, time.sleep, 0.5)  # the DISCONNECTs leave before we exit


# ------------------------------------------------------------------ the run

def pick_vhosts(n: int, workers: int) -> list[str]:
    """``n`` vhost names that the shard placement spreads over ``workers`` in turn."""
    out: list[str] = []
    for i in range(100000):
        name = f"idle{i}"
        if worker_of(name, workers) == len(out) % workers:
            out.append(name)
            if len(out) == n:
                return out
    raise RuntimeError("no spread of vhosts found")


def fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


def read_json(p: subprocess.Popen[str], deadline: float) -> dict[str, Any]:
    """The generator's next JSON line (the generators print one per command), by ``deadline``."""
    assert p.stdout is not None
    import selectors
    with selectors.DefaultSelector() as sel:
        sel.register(p.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if sel.select(timeout=1.0):
                line = p.stdout.readline()
                if not line:
                    raise RuntimeError(f"generator {p.pid} exited")
                if line.startswith("{"):
                    return dict(json.loads(line))
    raise RuntimeError(f"generator {p.pid} did not answer in time")


async def run(args: argparse.Namespace) -> dict[str, Any]:
    per_proc = -(-args.clients // args.procs)
    if per_proc > FILE_LIMIT - 500:
        raise SystemExit(f"{per_proc} clients per generator: more --procs (a process may open {FILE_LIMIT})")
    compileall.compile_dir(str(REPO_ROOT / "broker"), quiet=1)
    root = Path(tempfile.mkdtemp(prefix="mqtt-idle-"))
    b = Skred(root)
    b.p.extra_args += ["--workers", str(args.workers)]
    vhosts = pick_vhosts(args.vhosts, args.workers)
    gens: list[subprocess.Popen[str]] = []
    out: dict[str, Any] = {"clients": args.clients, "workers": args.workers, "vhosts": len(vhosts),
                           "procs": args.procs, "sources": args.sources}
    b.start()
    try:
        api_put(b.p, f"/api/users/{USER}", {"password": PASSWORD, "tags": ""})
        for v in vhosts:
            api_put(b.p, f"/api/vhosts/{v}")
            api_put(b.p, f"/api/permissions/{v}/{USER}", {"configure": ".*", "write": ".*", "read": ".*"})
        warm = await warm_up(b, vhosts)  # read_json below blocks this loop: they are idle meanwhile
        before = await settled_rss(b)
        procs0 = {pid: (fds(pid), vmrss_kib(pid) // 1024) for pid in tree(b.pids())}
        t0 = time.perf_counter()
        for i in range(args.procs):
            n = min(per_proc, args.clients - i * per_proc)
            gens.append(subprocess.Popen(
                [sys.executable, __file__, "--generate", "--port", str(b.port), "--count", str(n),
                 "--source", f"127.0.0.{2 + i % args.sources}", "--vhost-list", ",".join(vhosts),
                 "--prefix", f"g{i}-", "--at-once", str(args.at_once), "--budget", str(args.budget)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True))
        deadline = time.monotonic() + args.budget + 60
        reports = [read_json(g, deadline) for g in gens]
        out["connect_s"] = time.perf_counter() - t0
        out["held"] = sum(r["connected"] for r in reports)
        out["failed"] = sum(r["failed"] + r["dropped"] for r in reports)
        out["errors"] = sorted({r["error"] for r in reports if r["error"]})
        out["quarters_s"] = [r["quarters"] for r in reports]
        after = await settled_rss(b)
        # per process (the parent first): descriptors and RSS MiB, before -> after
        out["processes"] = {pid: [*procs0.get(pid, (0, 0)), fds(pid), vmrss_kib(pid) // 1024]
                            for pid in tree(b.pids())}
        out["before_mib"], out["after_mib"] = before / 1024, after / 1024
        out["per_conn_kib"] = (after - before) / max(1, out["held"])
        for g in gens:
            assert g.stdin is not None
            g.stdin.write("check\n")
            g.stdin.flush()
        checks = [read_json(g, time.monotonic() + 120) for g in gens]
        out["round_trips"] = sum(c["round_trips"] for c in checks)
        nv = len(vhosts)
        out["round_trips_asked"] = sum(min(nv, max(0, r["connected"] - nv)) for r in reports)
        out["round_trip_worst_ms"] = max(c["worst_ms"] for c in checks)
        out["still_open"] = sum(c["still_open"] for c in checks)
        close_all(warm)
    finally:
        for g in gens:
            try:
                assert g.stdin is not None
                g.stdin.write("close\n")
                g.stdin.close()
            except OSError:
                pass
        for g in gens:
            try:
                g.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(g.pid, 9)  # our own generator's group
                g.wait(10)
        b.close()
        shutil.rmtree(root, ignore_errors=True)
    return out


async def warm_up(b: Skred, vhosts: list[str]) -> list[Conn]:
    """Two clients per vhost, so every worker's MQTT state is made before the first reading."""
    return list(await asyncio.gather(*(open_one(b.host, b.port, "127.0.0.1", v, f"warm-{v}-{k}")
                                       for v in vhosts for k in range(2))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=50000)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--vhosts", type=int, default=4)
    ap.add_argument("--procs", type=int, default=4, help="load generator processes")
    ap.add_argument("--sources", type=int, default=4, help="source addresses 127.0.0.2 ...")
    ap.add_argument("--at-once", type=int, default=200, help="CONNECTs in flight per generator")
    ap.add_argument("--budget", type=float, default=900.0, help="seconds the clients may take to connect")
    ap.add_argument("--generate", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--count", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--source", default="127.0.0.1", help=argparse.SUPPRESS)
    ap.add_argument("--vhost-list", default="", help=argparse.SUPPRESS)
    ap.add_argument("--prefix", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    use_uvloop()
    if args.generate:
        asyncio.run(generate(args))
        return
    load0 = os.getloadavg()
    out = asyncio.run(run(args))
    out["load"] = [load0[0], os.getloadavg()[0]]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
