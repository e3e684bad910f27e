"""The worker fault of a multi-worker node (``[main] workers = 2``), for ``benchmarks/chaos.py``
and ``test_workers.py``: kill -9 of one worker under live traffic.

A trial: a confirmed publisher and an acking consumer on a durable queue of a vhost of the
victim worker, a confirmed publisher on a vhost of the other worker; kill -9 of the victim at
a random moment past one sync window; the parent restarts it. Goals (as ``single_faults``'
``live`` trial): no confirmed message lost, no ack older than the window back, every
delivered message back flagged redelivered; and the other worker's publisher saw no gap
between confirms over ``GAP_BOUND`` seconds while its neighbour died and came back.
"""

from __future__ import annotations

import base64
import json
import os
import random
import re
import signal
import threading
import time
import urllib.request
from collections.abc import Iterable

import pika

from broker.shards.placement import worker_of

from ._support import SkredProcess, connect, unique
from .single_faults import PERSISTENT, Trial, _msg, drain, fault_moment, score

WORKERS = 2
VHOSTS = {w: next(f"chaos{i}" for i in range(100) if worker_of(f"chaos{i}", WORKERS) == w)
          for w in range(WORKERS)}
GAP_BOUND = 1.0  # seconds the other worker's publisher may go without a confirm
RESTART_DEADLINE = 30.0


def prepare(b: SkredProcess, vhosts: Iterable[str] = VHOSTS.values()) -> None:
    """The trial's vhosts, with guest's permissions (idempotent)."""
    auth = "Basic " + base64.b64encode(b"guest:guest").decode()
    for vhost in vhosts:
        grant = {"configure": ".*", "write": ".*", "read": ".*"}
        for path, body in ((f"/api/vhosts/{vhost}", {}), (f"/api/permissions/{vhost}/guest", grant)):
            req = urllib.request.Request(f"http://127.0.0.1:{b.mgmt_port}{path}", method="PUT",
                                         data=json.dumps(body).encode(),
                                         headers={"Authorization": auth, "Content-Type": "application/json"})
            urllib.request.urlopen(req, timeout=30).read()


def worker_pids(b: SkredProcess) -> dict[int, int]:
    """The live pid of each worker, from the parent's log (a restart logs a new one)."""
    return {int(m.group(1)): int(m.group(2))
            for m in re.finditer(r"worker (\d+) started \(pid (\d+)\)", b.log_text())}


class _Traffic(threading.Thread):
    """Confirmed publishes to ``queue`` in ``vhost`` (and, with ``ack``, a consumer acking them)."""

    def __init__(self, b: SkredProcess, vhost: str, queue: str, consume: bool) -> None:
        super().__init__(daemon=True)
        self.b, self.vhost, self.queue, self.consume = b, vhost, queue, consume
        self.confirmed: list[tuple[int, float]] = []
        self.acked: list[tuple[int, float]] = []
        self.delivered: list[int] = []
        self.stop = threading.Event()

    def run(self) -> None:
        try:
            conn = connect(self.b, virtual_host=self.vhost)
            ch = conn.channel()
            ch.confirm_delivery()
            if self.consume:
                ch.basic_qos(prefetch_count=50)

                def on_message(c: pika.adapters.blocking_connection.BlockingChannel,
                               m: pika.spec.Basic.Deliver, _p: pika.BasicProperties, body: bytes) -> None:
                    n = int.from_bytes(body[:8], "big")
                    self.delivered.append(n)
                    c.basic_ack(m.delivery_tag)
                    self.acked.append((n, time.monotonic()))

                ch.basic_consume(self.queue, on_message)
            i = 0
            while not self.stop.is_set() and i < 1_000_000:
                ch.basic_publish("", self.queue, _msg(i), PERSISTENT)
                self.confirmed.append((i, time.monotonic()))
                i += 1
                if self.consume and i % 20 == 0:
                    conn.process_data_events(0)
        except (pika.exceptions.AMQPError, OSError):
            pass  # the kill


def _serving(b: SkredProcess, vhost: str) -> bool:
    try:
        connect(b, virtual_host=vhost).close()
        return True
    except (pika.exceptions.AMQPError, OSError):
        return False


def trial_worker_kill(b: SkredProcess, rng: random.Random, victim: int = 1) -> Trial:
    trial = Trial("worker kill -9")
    doomed, other = VHOSTS[victim], VHOSTS[1 - victim]
    q, q2 = unique("wk"), unique("wk-other")
    for vhost, queue in ((doomed, q), (other, q2)):
        conn = connect(b, virtual_host=vhost)
        conn.channel().queue_declare(queue, durable=True)
        conn.close()
    hit, bystander = _Traffic(b, doomed, q, True), _Traffic(b, other, q2, False)
    hit.start()
    bystander.start()
    fault_moment(hit.acked, rng)
    pid = worker_pids(b)[victim]
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    deadline = killed_at + RESTART_DEADLINE
    def back() -> bool:
        return worker_pids(b).get(victim, pid) != pid and _serving(b, doomed)

    while not back() and time.monotonic() < deadline:
        time.sleep(0.05)  # restart poll (bounded)
    if time.monotonic() >= deadline:
        trial.notes.append(f"worker {victim} not serving again within {RESTART_DEADLINE:g} s")
    hit.stop.set()
    bystander.stop.set()
    hit.join(10)
    bystander.join(10)
    if not b.alive():
        trial.deaths += 1
        trial.notes.append("the parent died")
        return trial
    got = drain(b, q, virtual_host=doomed)
    for vhost, queue in ((doomed, q), (other, q2)):
        conn = connect(b, virtual_host=vhost)
        conn.channel().queue_delete(queue)
        conn.close()
    score(trial, {n for n, _ in hit.confirmed}, hit.acked, hit.delivered, got, killed_at)
    trial.confirmed = len(hit.confirmed) + len(bystander.confirmed)
    times = [t for _n, t in bystander.confirmed if t >= killed_at - 1]
    gap = max((b2 - a for a, b2 in zip(times, times[1:], strict=False)), default=0.0)
    if not times or times[-1] < killed_at:
        trial.notes.append("the other worker's publisher stopped")
    elif gap > GAP_BOUND:
        trial.notes.append(f"the other worker's publisher waited {gap:.2f} s for a confirm")
    if "Traceback" in b.log_text():
        trial.tracebacks += 1
    return trial
