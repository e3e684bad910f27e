#!/usr/bin/env python3
"""A synchronous publisher beside a consumer draining a backlog, this tree against a baseline
commit in one run (issue 31: the synchronous publisher's slow calls behind a backlog drain).

Theory of operation: a queue's delivery pass runs inside one event-loop turn, and no other
connection's frame is read until it ends (broker/model/queue.py, "Fairness"). Each run starts
one Skred per tree (``quiet_latency.start_tree``; the baseline exported with ``git archive``),
stores ``--backlog`` messages of ``--body`` bytes in a queue in one write, then attaches a
consumer (a raw socket read in a thread: autoack, or manual ack with ``--prefetch`` acked in
multiples per read) and, meanwhile, a pika ``BlockingConnection`` with confirms publishes
transient messages to a queue of its own (their confirms wait for no disk: the call time is
the loop's), each call followed by ``queue.declare(passive)`` on the drained queue. Reported
per tree, medians over ``--runs`` (brokers alternate):

- the queue's step between consecutive answers (deliveries made between two of the publisher's
  round trips: whole passes, a count that does not move with load), median and largest;
- the publisher's call time during the drain, p50 / p99 / max (wall time: loaded-machine caveat);
- the drain: deliveries per second, and the broker's CPU microseconds per delivery (the cost
  of the smaller passes, if any; ``--quiet-drain`` measures it without the publisher, whose
  calls cost CPU of their own and, in this process, take the GIL from the consumer's reads);
  the loop thread's voluntary and involuntary context switches over the drain (waits, and
  preemptions by other runnable tasks).

Every loop is bounded in count and time.

    python benchmarks/drain_fairness.py --work /tmp/drain --baseline 16e9e6e --runs 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pika
from pamqp import commands
from pamqp import frame as pframe
from pamqp.body import ContentBody
from pamqp.header import ContentHeader

BENCH = Path(__file__).resolve().parent
REPO_ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(REPO_ROOT))

from quiet_latency import export, start_tree  # noqa: E402

from tests.integration._raw import RawConn  # noqa: E402
from tests.integration._support import cpu_seconds  # noqa: E402

DEADLINE_S = 60.0  # the longest one drain may take


def switches(pid: int) -> tuple[int, int]:
    """(voluntary, involuntary) context switches of ``pid``'s main thread (the event loop)."""
    got = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key.endswith("ctxt_switches"):
            got[key] = int(value)
    return got.get("voluntary_ctxt_switches", 0), got.get("nonvoluntary_ctxt_switches", 0)


def _consume(raw: RawConn, prefetch: int, stop: threading.Event) -> None:
    """Read whatever the consumer is sent; with manual ack, ack all delivered so far per read
    (``multiple``), by the last delivery tag seen (a delivery's tag follows its method id)."""
    sock = raw.sock
    sock.settimeout(0.2)
    tags = 0
    while not stop.is_set():
        try:
            data = sock.recv(1 << 20)
        except TimeoutError:
            continue
        except OSError:
            return
        if not data:
            return
        if prefetch:
            n = data.count(b"\x00\x3c\x00\x3c")  # basic.deliver's class and method
            if n:
                tags += n
                sock.sendall(pframe.marshal(commands.Basic.Ack(delivery_tag=tags, multiple=True), 1))


def one_run(uri: str, port: int, pid: int, backlog: int, body: int, prefetch: int, quiet: bool = False
            ) -> dict[str, Any]:
    conn = pika.BlockingConnection(pika.URLParameters(uri))
    ch = conn.channel()
    q = f"drain-{time.monotonic_ns()}"
    side = q + "-side"
    ch.queue_declare(q)
    ch.queue_declare(side)
    raw = RawConn("127.0.0.1", port)
    raw.handshake()
    raw.open_channel(1)
    payload = bytes(body)
    one = (pframe.marshal(commands.Basic.Publish(exchange="", routing_key=q), 1)
           + pframe.marshal(ContentHeader(0, body, commands.Basic.Properties()), 1)
           + pframe.marshal(ContentBody(payload), 1))
    raw.send(one * backlog)
    end = time.monotonic() + DEADLINE_S
    while ch.queue_declare(q, passive=True).method.message_count < backlog and time.monotonic() < end:
        time.sleep(0.01)
    pch = conn.channel()
    pch.confirm_delivery()
    if prefetch:
        raw.send_method(1, commands.Basic.Qos(prefetch_count=prefetch))
        raw.expect(commands.Basic.QosOk, 1)
    stop = threading.Event()
    reader = threading.Thread(target=_consume, args=(raw, prefetch, stop), daemon=True)
    cpu0 = cpu_seconds(pid)
    sw0 = switches(pid)
    t0 = time.monotonic()
    raw.send_method(1, commands.Basic.Consume(queue=q, consumer_tag="drain", no_ack=not prefetch))
    raw.expect(commands.Basic.ConsumeOk, 1)
    reader.start()
    seen = [backlog]
    calls: list[float] = []
    while seen[-1] and time.monotonic() < t0 + DEADLINE_S and len(calls) < 1_000_000:
        c0 = time.perf_counter()
        if quiet:
            time.sleep(0.01)  # the drain alone: its cost without a publisher's calls beside it
        else:
            pch.basic_publish("", side, b"sync", pika.BasicProperties(delivery_mode=1))
        calls.append((time.perf_counter() - c0) * 1e3)
        seen.append(ch.queue_declare(q, passive=True).method.message_count)
    elapsed = time.monotonic() - t0
    cpu = cpu_seconds(pid) - cpu0
    sw = [b - a for a, b in zip(sw0, switches(pid), strict=True)]
    stop.set()
    reader.join(5)
    raw.close()
    ch.queue_delete(q)
    ch.queue_delete(side)
    conn.close()
    steps = [a - b for a, b in zip(seen, seen[1:], strict=False) if a != b] or [0]
    calls.sort()
    return {"step median": statistics.median(steps), "step max": max(steps),
            "call p50 ms": calls[len(calls) // 2], "call p99 ms": calls[int(len(calls) * 0.99)],
            "call max ms": calls[-1], "calls": len(calls), "deliveries/s": backlog / elapsed,
            "broker CPU us/delivery": cpu / backlog * 1e6,
            "loop's voluntary switches": sw[0], "loop preempted": sw[1]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", required=True, type=Path, help="brokers' data, logs and the baseline tree")
    ap.add_argument("--baseline", default="16e9e6e", metavar="REV", help="the Skred to compare with")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--backlog", type=int, default=50_000)
    ap.add_argument("--body", type=int, default=64, help="body bytes of each backlog message")
    ap.add_argument("--prefetch", type=int, default=0, help="0: autoack; else manual ack, this prefetch")
    ap.add_argument("--quiet-drain", action="store_true",
                    help="no publisher: a passive declare every 10 ms (the drain's own cost)")
    args = ap.parse_args(argv)
    trees = {"this tree": REPO_ROOT, args.baseline: export(args.baseline, args.work / "baseline")}
    nodes = {name: start_tree(name, root, args.work / f"data-{i}", 1)
             for i, (name, root) in enumerate(trees.items())}
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    try:
        for run in range(args.runs):
            for name, node in nodes.items():
                port = int(node.uri.rsplit(":", 1)[1].split("/")[0])
                r = one_run(node.uri, port, node.pid, args.backlog, args.body, args.prefetch,
                            args.quiet_drain)
                results[name].append(r)
                print(f"run {run + 1} {name}: {r}", file=sys.stderr, flush=True)
    finally:
        for node in nodes.values():
            node.stop()
    metrics = list(next(iter(results.values()))[0])
    print(f"| metric (median of {args.runs}) | " + " | ".join(trees) + " |")
    print("| --- |" + " --- |" * len(trees))
    for m in metrics:
        cells = (f"{statistics.median(r[m] for r in results[n]):.4g}" for n in trees)
        print(f"| {m} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
