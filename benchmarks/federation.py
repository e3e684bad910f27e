#!/usr/bin/env python3
"""Federation throughput: Skred's federation links against RabbitMQ 3.10's federation plugin.

Boots its own brokers on loopback (free ports, private data dirs, stopped by PID): Skred ``A`` (an
upstream), Skred ``B`` (a downstream) and a RabbitMQ node ``R`` with ``rabbitmq_federation``
(tests/integration/conformance/_rabbit.py), which is a downstream for the plugin's moves and an
upstream for Skred's. A link always runs on its downstream, so each move names upstream ->
downstream and who runs the link:

- ``skred A->B``: Skred's link on B, a Skred upstream.
- ``plugin A->R``: RabbitMQ's plugin on R, the same Skred upstream.
- ``skred R->B``: Skred's link on B, a RabbitMQ upstream.
- ``plugin R->R``: RabbitMQ's plugin on R with a RabbitMQ upstream (vhost ``up`` of R itself,
  over a real connection: the only RabbitMQ-to-RabbitMQ move one node allows).

Each move, for each kind:

- ``exchange``: the downstream's fanout exchange is federated (policy ``federation-upstream``) and
  a durable queue bound to it; once the link has bound upstream, ``--messages`` persistent 1 KiB
  messages are published to the upstream exchange (confirmed, 500 in flight) and the move is
  timed from the first publish until the downstream queue holds them all: a federated exchange
  cannot be preloaded, so the publisher's pace is part of every row alike.
- ``queue``: the upstream queue is preloaded (not timed); the downstream queue is federated and
  a consumer (auto-ack) on it takes them all: timed from the policy until the last one arrived.

``--ack-mode`` is the upstream's ``ack-mode`` for both (default on-confirm); prefetch 1000 for both
(RabbitMQ's default). Every row has the CPU time per message of each broker process (A, B, R),
from /proc, as ``benchmarks/shovel.py`` reads it: on a loaded machine compare rows of one run
(the ratio) and the CPU per message, not absolute rates.

    python benchmarks/federation.py --messages 100000
"""

from __future__ import annotations

import sys
import time
import urllib.parse
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import pika  # noqa: E402
from shovel import chosen, cpu_seconds, move_args, process_ids, record, report, three_brokers  # noqa: E402  (benchmarks/ is not a package)

from tests.integration._shovel import publish  # noqa: E402
from tests.integration._support import unique, wait_until  # noqa: E402
from tests.integration.test_mgmt_api import Api  # noqa: E402

KINDS = ("exchange", "queue")
PREFETCH = 1000  # both: RabbitMQ's default prefetch-count
UP_VHOST = "up"  # R's vhost that is the upstream of the plugin's R->R move


def q(name: str) -> str:
    return urllib.parse.quote(name, safe="")


class Side:
    """One broker as an end of a move: its AMQP URL (vhost), management API and vhost."""

    def __init__(self, port: int, mgmt_port: int, vhost: str = "/") -> None:
        self.port, self.api, self.vhost = port, Api(mgmt_port), vhost

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}/{q(self.vhost)}"


def _declare(side: Side, exchange: str | None, queue: str) -> None:
    with pika.BlockingConnection(pika.URLParameters(side.url)) as conn:
        ch = conn.channel()
        ch.queue_declare(queue, durable=True)
        if exchange is not None:
            ch.exchange_declare(exchange, "fanout", durable=True)
            ch.queue_bind(queue, exchange, "")


def _federate(down: Side, up: Side, name: str, kind: str, ack_mode: str) -> None:
    value = {"uri": up.url, "prefetch-count": PREFETCH, "ack-mode": ack_mode, "reconnect-delay": 1}
    down.api.ok("PUT", f"/api/parameters/federation-upstream/{q(down.vhost)}/{q(name)}", {"value": value})
    down.api.ok("PUT", f"/api/policies/{q(down.vhost)}/{q(name)}", {
        "pattern": f"^{name}$", "definition": {"federation-upstream": name}, "apply-to": f"{kind}s"})


def _unfederate(down: Side, name: str) -> None:
    down.api.call("DELETE", f"/api/policies/{q(down.vhost)}/{q(name)}")
    down.api.call("DELETE", f"/api/parameters/federation-upstream/{q(down.vhost)}/{q(name)}")


def _bound_upstream(up: Side, exchange: str) -> bool:
    status, found, _ = up.api.call("GET", f"/api/exchanges/{q(up.vhost)}/{q(exchange)}/bindings/source")
    return status == 200 and any(str(b.get("destination", "")).startswith("federation:") for b in found)


def _wait_count(side: Side, queue: str, n: int, timeout: float) -> None:
    """Until ``queue`` holds ``n`` messages, polled every 20 ms with a passive declare on one
    connection (far cheaper for the broker than an API call or a connection per look)."""
    with pika.BlockingConnection(pika.URLParameters(side.url)) as conn:
        ch = conn.channel()
        wait_until(lambda: ch.queue_declare(queue, passive=True).method.message_count >= n, timeout,
                   f"{n} federated")


def _consume(side: Side, queue: str, n: int, timeout: float) -> None:
    """Take ``n`` messages from ``queue`` (auto-ack) within ``timeout`` seconds."""
    got = 0
    with pika.BlockingConnection(pika.URLParameters(side.url)) as conn:
        ch = conn.channel()
        ch.basic_qos(prefetch_count=PREFETCH)

        def on(_ch: Any, _m: Any, _p: Any, _b: bytes) -> None:
            nonlocal got
            got += 1
        ch.basic_consume(queue, on, auto_ack=True)
        deadline = time.monotonic() + timeout
        while got < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{got} of {n} messages arrived in {timeout:g} s")
            conn.process_data_events(0.05)


def one_move(kind: str, up: Side, down: Side, n: int, ack_mode: str, timeout: float,
             pids: dict[str, int]) -> tuple[float, dict[str, float]]:
    """Messages per second of one move and the CPU microseconds per message of each broker."""
    name = unique(f"fedbench.{kind}")
    sink = f"{name}.sink" if kind == "exchange" else name
    _declare(down, name if kind == "exchange" else None, sink)
    try:
        if kind == "exchange":
            _declare(up, name, f"{name}.upstream-sink")  # the upstream's own consumer of it
            _federate(down, up, name, kind, ack_mode)
            wait_until(lambda: _bound_upstream(up, name), 60, "the link bound upstream")
            cpu0 = {k: cpu_seconds(pid) for k, pid in pids.items()}
            t0 = time.perf_counter()
            publish(up.url, "", "f", n, size=1024, exchange=name)
            _wait_count(down, sink, n, timeout)
        else:
            publish(up.url, name, "f", n, size=1024, declare={})
            cpu0 = {k: cpu_seconds(pid) for k, pid in pids.items()}
            t0 = time.perf_counter()
            _federate(down, up, name, kind, ack_mode)
            _consume(down, sink, n, timeout)
        elapsed = time.perf_counter() - t0
        cpu = {k: (cpu_seconds(pid) - cpu0[k]) * 1e6 / n for k, pid in pids.items()}
    finally:
        _unfederate(down, name)
        for side, queue in ((down, sink), (up, f"{name}.upstream-sink" if kind == "exchange" else name)):
            side.api.call("DELETE", f"/api/queues/{q(side.vhost)}/{q(queue)}")
    return n / elapsed, cpu


def main() -> None:
    ap = move_args(__doc__, 100_000, 900.0)
    ap.add_argument("--kinds", default=",".join(KINDS), help="exchange, queue (comma-separated)")
    ap.add_argument("--ack-mode", default="on-confirm", choices=("on-confirm", "on-publish", "no-ack"))
    args = ap.parse_args()
    results: list[dict[str, Any]] = []
    plugins = ("rabbitmq_federation", "rabbitmq_federation_management")
    with three_brokers("federation", "skredfedbench", plugins) as (rabbit, a, b):
        assert rabbit.mgmt_port is not None
        r_api = Api(rabbit.mgmt_port)
        r_api.ok("PUT", f"/api/vhosts/{UP_VHOST}")
        everything = {"configure": ".*", "write": ".*", "read": ".*"}
        r_api.ok("PUT", f"/api/permissions/{UP_VHOST}/guest", everything)
        side_a, side_b = Side(a.port, a.mgmt_port), Side(b.port, b.mgmt_port)
        side_r, side_r_up = Side(rabbit.port, rabbit.mgmt_port), Side(rabbit.port, rabbit.mgmt_port, UP_VHOST)
        pids = process_ids(rabbit, a, b)
        moves = [("skred A->B", side_a, side_b), ("plugin A->R", side_a, side_r),
                 ("skred R->B", side_r_up, side_b), ("plugin R->R", side_r_up, side_r)]
        for kind in args.kinds.split(","):
            for label, up, down in moves:
                if not chosen(args.moves, label):
                    continue
                rate, cpu = one_move(kind, up, down, args.messages, args.ack_mode, args.timeout, pids)
                record(results, {"move": label, "kind": kind}, f"{label:12} {kind:9}", rate, cpu)
    report(results, {"messages": args.messages, "ack_mode": args.ack_mode}, args.json,
           f"{args.messages} messages of 1 KiB per move, ack-mode {args.ack_mode}",
           [("move", "move", 12), ("kind", "kind", 9)])


if __name__ == "__main__":
    main()
