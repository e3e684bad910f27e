#!/usr/bin/env python3
"""Issue 27: a node of 2 workers against a node of 1, two vhosts each under workload (2).

Two Skred nodes are started here (``--workers 1`` and ``--workers 2``), each with two vhosts
that the shard map places on different workers of the 2-worker node. A run puts workload (2)
of ``benchmarks/run.py`` (varied 200 B-2 KiB messages, 4 producers and 4 consumers on 4
queues: ``workloads.py varied --pairs 4``) on both vhosts of one node at once and adds the two
consume rates up; runs alternate between the nodes, so background load hits both alike. The
table shows the median of ``--runs`` runs per node and the ratio.

The load generator (``--client``) is by default ``benchmarks/c/skload.c``, compiled here with
``cc``: workload (2)'s varied messages from C threads, one connection each, cheap enough that
the broker and not the client is the bottleneck (the issue's 1.7x measurement).
``--client python`` runs workloads.py's generator instead (pre-encoded frames on raw asyncio
connections, one process per client), which on a 2-core machine competes with the broker
for the cores. Broker CPU seconds per run (parent and workers, from /proc) are shown beside
the rates.

    python benchmarks/workers.py --seconds 5 --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from broker.shards.placement import worker_of  # noqa: E402
from tests.integration._support import SkredProcess, free_port  # noqa: E402

# one vhost on each worker of the 2-worker node
VHOSTS = [next(f"bench{i}" for i in range(100) if worker_of(f"bench{i}", 2) == w) for w in (0, 1)]


def api_put(b: SkredProcess, path: str, body: dict[str, str] | None = None) -> None:
    import base64
    import urllib.request

    auth = "Basic " + base64.b64encode(b"guest:guest").decode()
    req = urllib.request.Request(f"http://127.0.0.1:{b.mgmt_port}{path}", method="PUT",
                                 data=json.dumps(body or {}).encode(),
                                 headers={"Authorization": auth, "Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=30).read()


def start(work: Path, workers: int) -> SkredProcess:
    b = SkredProcess(work / f"w{workers}",
                     ["--workers", str(workers), "--mgmt-metrics-port", str(free_port())])
    b.start()
    for vhost in VHOSTS:
        api_put(b, f"/api/vhosts/{vhost}")
        api_put(b, f"/api/permissions/{vhost}/guest", {"configure": ".*", "write": ".*", "read": ".*"})
    return b


def cpu_seconds(pid: int) -> float:
    """CPU time of ``pid`` and its children (the workers), alive or reaped."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    pids = [pid]
    try:
        pids += [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        pass
    for p in pids:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(x) for x in fields[11:15]) / tick  # utime stime cutime cstime
    return total


def build_skload(work: Path) -> Path:
    """benchmarks/c/skload.c compiled into ``work``."""
    out = work / "skload"
    source = REPO_ROOT / "benchmarks" / "c" / "skload.c"
    subprocess.run(["cc", "-O2", "-pthread", "-o", str(out), str(source)], check=True)
    return out


def run_c(skload: Path, b: SkredProcess, seconds: float, pairs: int) -> tuple[float, float, float]:
    """Both vhosts from one skload process (its threads): the consume rate, the broker's CPU seconds
    over the whole run, and the load generator's over its measured window."""
    cpu0 = cpu_seconds(b.pid or 0)
    p = subprocess.run([str(skload), "127.0.0.1", str(b.port), f"{seconds:g}", str(pairs), *VHOSTS],
                       capture_output=True, text=True, timeout=seconds + 60)
    lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"skload failed ({p.returncode}): {p.stderr.strip()[-500:]}")
    result = json.loads(lines[-1])
    return float(result["consume_rate"]), cpu_seconds(b.pid or 0) - cpu0, float(result["cpu_seconds"])


def run_once(b: SkredProcess, seconds: float, pairs: int = 4) -> tuple[float, float, float]:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    cpu0 = cpu_seconds(b.pid or 0)
    procs = [subprocess.Popen([sys.executable, str(REPO_ROOT / "benchmarks" / "workloads.py"), "varied",
                               "--pairs", str(pairs), "-z", f"{seconds:g}",
                               "--uri", f"amqp://guest:guest@127.0.0.1:{b.port}/{vhost}"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                              cwd=REPO_ROOT)
             for vhost in VHOSTS]
    total = 0.0
    for p in procs:
        out, err = p.communicate(timeout=seconds * 3 + 120)
        lines = [line for line in out.splitlines() if line.startswith("{")]
        if p.returncode != 0 or not lines:
            raise RuntimeError(f"workload failed ({p.returncode}): {err.strip()[-500:]}")
        total += float(json.loads(lines[-1])["consume_rate"])
    return total, cpu_seconds(b.pid or 0) - cpu0, float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--pairs", type=int, default=4,
                    help="producer/consumer pairs per vhost (4: workload (2); 1: workload (1), for a machine "
                         "too loaded to encode workload (2)'s messages within workloads.py's 60 s)")
    ap.add_argument("--client", choices=("c", "python"), default="c",
                    help="load generator: c (benchmarks/c/skload.c, built with cc) or python (workloads.py)")
    args = ap.parse_args()
    rates: dict[int, list[float]] = {1: [], 2: []}
    cpus: dict[int, list[float]] = {1: [], 2: []}
    client_cpus: dict[int, list[float]] = {1: [], 2: []}
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="skred-workers-bench-") as tmp:
        skload = build_skload(Path(tmp)) if args.client == "c" else None
        nodes = {n: start(Path(tmp), n) for n in (1, 2)}
        try:
            for run in range(args.runs):
                for n, b in nodes.items():
                    rate, cpu, client_cpu = (run_c(skload, b, args.seconds, args.pairs) if skload is not None
                                 else run_once(b, args.seconds, args.pairs))
                    rates[n].append(rate)
                    cpus[n].append(cpu)
                    client_cpus[n].append(client_cpu)
                    print(f"run {run + 1}: {n} worker(s): {rate:,.0f} msg/s, broker CPU {cpu:.1f} s, "
                          f"load generator CPU {client_cpu:.1f} s",
                          file=sys.stderr, flush=True)
        finally:
            for b in nodes.values():
                b.stop()
                b.close()
    med = {n: statistics.median(v) for n, v in rates.items()}
    what = "workload (2)" if args.pairs == 4 else f"workload (1) with {args.pairs} pair(s)"
    what += f", {args.client} client"
    print(f"| workers | {what} on 2 vhosts at once, msg/s (median of {args.runs}) | broker CPU s per run "
          f"| load generator CPU s per {args.seconds:g} s window |")
    print("| --- | --- | --- | --- |")
    for n in (1, 2):
        print(f"| {n} | {med[n]:,.0f} | {statistics.median(cpus[n]):.1f} "
              f"| {statistics.median(client_cpus[n]):.1f} |")
    print(f"\nratio 2/1: {med[2] / med[1]:.2f}; load average at start {load:.1f} on {os.cpu_count()} cores; "
          f"{time.strftime('%Y-%m-%d %H:%M %Z')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
