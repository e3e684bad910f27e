#!/usr/bin/env python3
"""How long a node with many durable queues takes to come back after a stop.

One private ``skred`` process on free ports and a temp data dir: declare ``--queues`` durable
queues (pipelined in batches on one connection), bind every ``--bind-every``-th of them to
``amq.direct``, publish ``--messages`` persistent messages (confirmed) to every
``--msg-every``-th queue and get + ack half of them. Then, for each stop kind (a clean
SIGTERM stop, and kill -9), stop the broker, start it again on the same data dir and time
from the process start to

- ``port``: the AMQP port answers the protocol header with connection.start, and
- ``ready``: a passive ``queue.declare`` of the last queue declared answers,

and reports the broker's CPU time by then (user + system, the figure a shared machine does
not distort) and when its log says every store has been recovered (a node reads its
queues' stores after it serves, or on first use).

After each restart it checks that every queue is there and the queues with messages hold
exactly the unacked ones (a restart that is fast because it forgot something is a failure).
Every loop is bounded by the counts given; each restart by ``--deadline`` seconds.

    python benchmarks/restart.py --queues 50000
    python benchmarks/restart.py --queues 10000 --runs 3 --stops clean
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pika

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from broker.perf import codec  # noqa: E402
from broker.perf.client import AmqpUri, Client  # noqa: E402
from tests.integration._support import SkredProcess, amqp_answers  # noqa: E402

BATCH = 1000  # declares (or binds) sent before their replies are read


def queue_name(i: int) -> str:
    return f"restart-bench-{i:06d}"


def populate(b: SkredProcess, queues: int, bind_every: int, msg_every: int, messages: int) -> dict[str, int]:
    """Declare, bind and fill; returns the message count each queue with messages must have."""
    client = Client(AmqpUri.parse(b.url), timeout=60.0, name="restart-bench")
    try:
        started = time.monotonic()
        for first in range(0, queues, BATCH):
            names = [queue_name(i) for i in range(first, min(first + BATCH, queues))]
            client.send(b"".join(codec.queue_declare(1, n, durable=True) for n in names))
            for _ in names:
                client.wait_for(codec.QUEUE_DECLARE_OK, timeout=60.0)
            bound = [n for i, n in enumerate(names, first) if i % bind_every == 0]
            if bound:
                client.send(b"".join(codec.queue_bind(1, n, "amq.direct", n) for n in bound))
                for _ in bound:
                    client.wait_for(codec.QUEUE_BIND_OK, timeout=60.0)
        print(f"declared {queues:,} queues in {time.monotonic() - started:.1f} s", flush=True)
    finally:
        client.close()
    expected: dict[str, int] = {}
    conn = pika.BlockingConnection(pika.URLParameters(b.url))
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        persistent = pika.BasicProperties(delivery_mode=2)
        for i in range(0, queues, msg_every):
            name = queue_name(i)
            for k in range(messages):
                ch.basic_publish("", name, b"m%d" % k, persistent)
            acked = 0
            for _ in range(messages // 2):
                method, _props, _body = ch.basic_get(name)
                if method is not None:
                    ch.basic_ack(method.delivery_tag)
                    acked += 1
            expected[name] = messages - acked
    finally:
        conn.close()
    return expected


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) the process has used: on a shared machine, the figure that
    does not depend on what else runs."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


RECOVERED = "queue stores recovered"  # the node's line once its background reader is done


def time_start(b: SkredProcess, last: str, deadline: float,
               wait_recovered: bool) -> tuple[float, float, float, float]:
    """Seconds to the AMQP port answering, to a passive declare of ``last``, the broker's
    CPU seconds by then, and seconds until every store was recovered (the node's log; a
    broker that recovers every store before it serves does not say so: ``ready`` then)."""
    logged = b.log_text().count(RECOVERED)
    t0 = time.monotonic()
    proc = b.spawn()
    end = t0 + deadline
    while not amqp_answers(b.host, b.port, timeout=5.0):
        if proc.poll() is not None:
            raise SystemExit(f"broker exited with {proc.returncode}:\n{b.log_tail()}")
        if time.monotonic() > end:
            raise SystemExit(f"broker not answering within {deadline} s:\n{b.log_tail()}")
        time.sleep(0.02)  # poll interval of a readiness loop with a deadline
    port = time.monotonic() - t0
    conn = pika.BlockingConnection(pika.URLParameters(b.url))
    try:
        conn.channel().queue_declare(last, passive=True)
        ready = time.monotonic() - t0
    finally:
        conn.close()
    cpu = cpu_seconds(proc.pid)
    while wait_recovered and b.log_text().count(RECOVERED) == logged:
        if time.monotonic() > end:
            raise SystemExit(f"stores not recovered within {deadline} s:\n{b.log_tail()}")
        time.sleep(0.1)  # poll interval of a wait with a deadline
    return port, ready, cpu, time.monotonic() - t0


def verify(b: SkredProcess, queues: int, expected: dict[str, int]) -> None:
    """Every queue is back, and every queue with messages holds exactly its unacked ones."""
    client = Client(AmqpUri.parse(b.url), timeout=60.0, name="restart-bench-verify")
    try:
        for first in range(0, queues, BATCH):
            names = [queue_name(i) for i in range(first, min(first + BATCH, queues))]
            client.send(b"".join(codec.queue_declare(1, n, passive=True) for n in names))
            for _ in names:
                client.wait_for(codec.QUEUE_DECLARE_OK, timeout=60.0)  # a 404 raises
    finally:
        client.close()
    conn = pika.BlockingConnection(pika.URLParameters(b.url))
    try:
        ch = conn.channel()
        for name, count in expected.items():
            got = ch.queue_declare(name, passive=True).method.message_count
            if got != count:
                raise SystemExit(f"{name}: {got} messages after the restart, expected {count}")
    finally:
        conn.close()


def stop(b: SkredProcess, kind: str) -> float:
    t0 = time.monotonic()
    if kind == "kill9":
        b.kill9()
    else:
        assert b.proc is not None
        b.proc.terminate()
        try:
            b.proc.wait(600)
        except subprocess.TimeoutExpired:
            b.kill9()
            raise SystemExit("broker ignored SIGTERM for 600 s") from None
    return time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--queues", type=int, default=50_000)
    ap.add_argument("--bind-every", type=int, default=10, help="bind every n-th queue to amq.direct")
    ap.add_argument("--msg-every", type=int, default=1000, help="put messages in every n-th queue")
    ap.add_argument("--messages", type=int, default=10, help="persistent messages per such queue")
    ap.add_argument("--runs", type=int, default=1, help="restarts per stop kind")
    ap.add_argument("--stops", default="clean,kill9", help="comma-separated: clean, kill9")
    ap.add_argument("--deadline", type=float, default=600.0, help="seconds a restart may take")
    ap.add_argument("--data-dir", type=Path, help="keep the data here (default: a temp dir)")
    ap.add_argument("--no-wait-recovered", action="store_true",
                    help="for a broker that recovers every store before it serves (older releases)")
    args = ap.parse_args(argv)
    if not 0 < args.queues <= 1_000_000 or args.runs > 20:
        ap.error("--queues must be in 1..1,000,000 and --runs at most 20")
    stops = [s for s in args.stops.split(",") if s]
    with tempfile.TemporaryDirectory(prefix="skred-restart-") as tmp:
        data = args.data_dir or Path(tmp) / "data"
        b = SkredProcess(data, ["--log-level", "info"])
        try:
            b.start()
            expected = populate(b, args.queues, args.bind_every, args.msg_every, args.messages)
            last = queue_name(args.queues - 1)
            rows = []
            for kind in stops:
                runs = []
                for _ in range(args.runs):
                    took = stop(b, kind)
                    run = time_start(b, last, args.deadline, not args.no_wait_recovered)
                    verify(b, args.queues, expected)
                    print(f"{kind}: stop {took:.2f} s, port {run[0]:.2f} s, ready {run[1]:.2f} s "
                          f"(broker CPU {run[2]:.2f} s), all stores read {run[3]:.2f} s", flush=True)
                    runs.append(run)
                rows.append((kind, *(statistics.median(r[i] for r in runs) for i in range(4))))
            print("\n| queues | stop | AMQP port answers (s) | passive declare of the last queue (s) "
                  "| broker CPU by then (s) | every store recovered (s) |")
            print("| ---: | --- | ---: | ---: | ---: | ---: |")
            for kind, port, ready, cpu, read in rows:
                print(f"| {args.queues:,} | {kind} | {port:.1f} | {ready:.1f} | {cpu:.1f} | {read:.1f} |")
        finally:
            b.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
