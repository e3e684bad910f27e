#!/usr/bin/env python3
"""How long the management API takes to answer what the web UI asks for, with many queues.

The UI's queue list asks for one page (``/api/queues?page=1&page_size=50&sort=name``), never the
whole list. This declares ``--queues`` queues on a running broker (Skred or RabbitMQ, both serve
the same API), then times each of the UI's requests ``--runs`` times and prints the median and the
maximum in milliseconds. It deletes the queues it declared.

    python benchmarks/mgmt_pages.py --amqp amqp://guest:guest@127.0.0.1:5672/ \\
        --http http://127.0.0.1:15672 --queues 10000
"""

from __future__ import annotations

import argparse
import base64
import statistics
import time
import urllib.request
import uuid

import pika

REQUESTS = [
    "/api/overview",
    "/api/queues?page=1&page_size=50&sort=name&sort_reverse=false",
    "/api/queues?page=1&page_size=50&sort=messages_ready&sort_reverse=true",
    "/api/queues?page=1&page_size=50&name=^bench-9&use_regex=true",
    "/api/exchanges?page=1&page_size=50&sort=name",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--amqp", default="amqp://guest:guest@127.0.0.1:5672/%2F")
    ap.add_argument("--http", default="http://127.0.0.1:15672")
    ap.add_argument("--user", default="guest")
    ap.add_argument("--password", default="guest")
    ap.add_argument("--queues", type=int, default=10_000)
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    auth = "Basic " + base64.b64encode(f"{args.user}:{args.password}".encode()).decode()
    prefix = f"bench-{uuid.uuid4().hex[:4]}-"
    conn = pika.BlockingConnection(pika.URLParameters(args.amqp))
    ch = conn.channel()
    started = time.monotonic()
    for i in range(args.queues):
        ch.queue_declare(f"{prefix}{i}")
        if i and i % 2000 == 0:
            print(f"declared {i} queues ({time.monotonic() - started:.0f} s)", flush=True)
    try:
        print(f"{'request':<75} {'median ms':>10} {'max ms':>8}")
        for path in REQUESTS:
            times = []
            for _ in range(args.runs):
                req = urllib.request.Request(args.http + path.replace("^bench-", "^" + prefix),
                                             headers={"Authorization": auth})
                t0 = time.perf_counter()
                with urllib.request.urlopen(req, timeout=60) as resp:
                    resp.read()
                times.append((time.perf_counter() - t0) * 1000)
            print(f"{path:<75} {statistics.median(times):>10.1f} {max(times):>8.1f}")
    finally:
        for i in range(args.queues):
            ch.queue_delete(f"{prefix}{i}")
        conn.close()


if __name__ == "__main__":
    main()
